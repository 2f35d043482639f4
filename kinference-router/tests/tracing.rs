//! Traces over OTLP/HTTP to a real receiver: the OpenTelemetry protocol's
//! own protobuf messages, decoded by the `opentelemetry-proto` Python
//! package (`pip install opentelemetry-proto`). A client's `traceparent` is
//! continued, each stage is a child span, and the engine gets the proxy
//! span's `traceparent`.

mod support;

use std::io::BufRead as _;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use support::*;

/// Receives `POST /v1/traces` (protobuf), prints its port, and appends one
/// JSON line per span to the file named by argv[1].
const RECEIVER: &str = r#"
import json, sys, http.server
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

out = open(sys.argv[1], "a", buffering=1)

def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None

class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.write(json.dumps({
                        "service": resource.get("service.name"),
                        "name": s.name, "kind": s.kind,
                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                    }) + "\n")
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
    def log_message(self, *a):
        pass

srv = http.server.HTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"#;

struct Receiver {
    child: std::process::Child,
    port: u16,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

fn receiver(spans: &Path) -> Receiver {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let check = std::process::Command::new(&python)
        .args([
            "-c",
            "from opentelemetry.proto.collector.trace.v1 import trace_service_pb2",
        ])
        .output();
    assert!(
        check.is_ok_and(|o| o.status.success()),
        "this test needs python3 with the OTLP messages: pip install opentelemetry-proto"
    );
    let mut child = std::process::Command::new(&python)
        .args(["-c", RECEIVER])
        .arg(spans)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the OTLP receiver");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the receiver prints its port");
    let port = line.trim().parse().expect("a port");
    Receiver { child, port }
}

fn spans(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_traced_over_otlp_and_continue_at_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("spans.jsonl");
    let rx = receiver(&file);
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let endpoint = format!("http://127.0.0.1:{}", rx.port);
    let r = RouterProc::start_with_env(
        &addrs,
        &WorkerSetOpts::default(),
        &["--otlp-endpoint", &endpoint],
        "warn",
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    )
    .await;

    // A client already in a trace (sampled).
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{client_trace}-{client_span}-01");
    let mut streamed = chat(MODEL, &words(0, 64), true, 4);
    streamed["stream_options"] = serde_json::json!({"include_usage": true});
    let body = Bytes::from(serde_json::to_vec(&streamed).unwrap());
    let reply = send(
        r.api,
        "POST",
        "/v1/chat/completions",
        &[("traceparent", &traceparent)],
        body,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // And one that starts its own.
    let alone = post(
        r.api,
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}),
    )
    .await;
    assert_eq!(alone.status, 200);

    let all = eventually(Duration::from_secs(15), "both requests' spans", || async {
        let s = spans(&file);
        let roots = s
            .iter()
            .filter(|x| x["name"].as_str().is_some_and(|n| n.starts_with("POST ")))
            .count();
        (roots >= 2 && s.iter().filter(|x| x["name"] == "proxy").count() >= 2).then_some(s)
    })
    .await;
    let root = all
        .iter()
        .find(|s| s["name"] == "POST /v1/chat/completions")
        .unwrap_or_else(|| panic!("no request span: {all:#?}"));
    assert_eq!(root["service"], "kinference-router");
    assert_eq!(root["kind"], 2, "a server span");
    assert_eq!(root["trace_id"], client_trace, "the client's trace goes on");
    assert_eq!(root["parent_span_id"], client_span);
    let a = &root["attributes"];
    assert_eq!(a["http.response.status_code"], 200);
    assert_eq!(a["gen_ai.request.model"], MODEL);
    assert_eq!(a["kinference.worker_set"], "sim");
    assert_eq!(a["kinference.engine"], addrs[0].http.to_string());
    assert_eq!(a["gen_ai.usage.output_tokens"], 4);
    assert_eq!(
        a["kinference.request_id"],
        reply.headers["x-request-id"].to_str().unwrap()
    );
    let children: Vec<&str> = all
        .iter()
        .filter(|s| s["parent_span_id"] == root["span_id"])
        .filter_map(|s| s["name"].as_str())
        .collect();
    for stage in ["prepare", "decide", "proxy"] {
        assert!(
            children.contains(&stage),
            "no {stage} span under the request: {children:?}"
        );
    }
    let proxy = all
        .iter()
        .find(|s| s["name"] == "proxy" && s["parent_span_id"] == root["span_id"])
        .unwrap();
    // The engine was handed this attempt's span as its parent.
    let at_engine = sims[0].trace_parents();
    let expected = format!(
        "00-{client_trace}-{}-01",
        proxy["span_id"].as_str().unwrap()
    );
    assert!(
        at_engine.contains(&expected),
        "{expected} not in {at_engine:?}"
    );
    // The other request is a trace of its own.
    let other = all
        .iter()
        .find(|s| s["name"] == "POST /v1/completions")
        .unwrap();
    assert_ne!(other["trace_id"], client_trace);
    assert_eq!(other["parent_span_id"], "");
    drop(r.stop());
}
