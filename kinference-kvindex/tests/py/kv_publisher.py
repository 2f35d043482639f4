"""A real ZeroMQ KV-event publisher for the subscriber tests (pyzmq/libzmq).

It behaves like vLLM's/SGLang's ZmqEventPublisher on the wire: an XPUB
(a PUB that also shows us subscriptions) sends [topic, seq(8 bytes BE),
payload]; a ROUTER answers replay requests [id, "", start_seq] with every
buffered batch whose seq >= start_seq, then the end marker, in the old
([seq, payload]) or new ([topic, seq, payload]) layout.

Usage: python3 kv_publisher.py PLAN.json. Prints "PORTS <pub> <replay>"
once bound, runs the plan's steps, then serves replay until stdin closes
or `linger` seconds pass. Steps:
  {"op": "wait_sub"}                     wait until a subscriber subscribed
                                         (and stayed, SETTLE seconds)
  {"op": "send", "seq": N, "file": F, "publish": true}
                                         buffer (and publish) payload file F
  {"op": "sleep", "s": 0.2}
  {"op": "restart"}                      close the PUB, clear the replay
                                         buffer, bind again on the same port
  {"op": "wait_stdin"}                   wait for a line on stdin
"""

import json
import struct
import sys
import threading
import time

import zmq

END = b"\xff" * 8
# How long a subscription must stand before `wait_sub` counts it: longer
# than the subscriber's connect timeout (500 ms), within which an attempt
# it abandons ends.
SETTLE = 0.75


def main():
    plan = json.load(open(sys.argv[1]))
    topic = plan.get("topic", "").encode()
    layout = plan.get("layout", "new")
    ctx = zmq.Context()

    def bind_pub(port=None):
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = s.bind_to_random_port("tcp://127.0.0.1")
        else:
            for _ in range(100):
                try:
                    s.bind("tcp://127.0.0.1:%d" % port)
                    break
                except zmq.ZMQError:
                    time.sleep(0.05)
        return s, port

    # Pick ports first, so a delayed bind can still announce them.
    probe = ctx.socket(zmq.PUB)
    pub_port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    print("PORTS %d %d" % (pub_port, replay_port), flush=True)
    time.sleep(plan.get("delay_bind", 0.0))
    pub, _ = bind_pub(pub_port)

    lock = threading.Lock()
    ring = []  # (seq, payload)
    stop = threading.Event()

    def serve_replay():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue
            ident = frames[0]
            (start,) = struct.unpack(">Q", frames[2])
            with lock:
                items = [(s, p) for (s, p) in ring if s >= start]
            for s, p in items:
                body = [struct.pack(">Q", s), p]
                if layout == "new":
                    body = [topic] + body
                router.send_multipart([ident, b""] + body)
            end = [END, b""] if layout == "old" else [b"", END, b""]
            router.send_multipart([ident, b""] + end)

    if plan.get("replay", True):
        threading.Thread(target=serve_replay, daemon=True).start()

    def wait_sub():
        # A subscription that lasts SETTLE seconds. On a loaded machine the
        # subscriber may give up on a connect attempt (its own timeout)
        # after this side accepted it and saw it subscribe; what is
        # published then goes down the abandoned connection, the retry
        # connects fine and waits for batches that never come. The
        # abandoned one's end shows here as an unsubscribe: start again.
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)
        deadline = time.time() + 20
        since = None
        while time.time() < deadline:
            if since is not None and time.time() - since >= SETTLE:
                return
            if poller.poll(50):
                msg = pub.recv()
                if msg[:1] == b"\x01" and since is None:
                    since = time.time()
                elif msg[:1] == b"\x00":
                    since = None
        print("NO SUBSCRIBER", flush=True)
        sys.exit(3)

    for step in plan["steps"]:
        op = step["op"]
        if op == "wait_sub":
            wait_sub()
        elif op == "send":
            payload = open(step["file"], "rb").read()
            with lock:
                ring.append((step["seq"], payload))
            if step.get("publish", True):
                pub.send_multipart([topic, struct.pack(">Q", step["seq"]), payload])
        elif op == "sleep":
            time.sleep(step["s"])
        elif op == "restart":
            pub.close(linger=0)
            with lock:
                ring.clear()
            time.sleep(step.get("down", 0.3))
            pub, _ = bind_pub(pub_port)
        elif op == "wait_stdin":
            sys.stdin.readline()
        print("DONE %s" % op, flush=True)
    print("PLAN DONE", flush=True)
    deadline = time.time() + plan.get("linger", 30)
    while time.time() < deadline:
        line = sys.stdin.readline()
        if not line:
            break
    stop.set()


if __name__ == "__main__":
    main()
