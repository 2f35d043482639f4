//! Replay fetching: one request to a publisher's replay ROUTER on a fresh
//! DEALER ([`fetch_replay`]), and which of its errors mean the endpoint is
//! not there at all ([`is_unreachable`]).

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::codec::frames::{self, ReplayReply};

/// Whether a replay error means the endpoint is not there (as opposed to a
/// reply that was wrong or late once it had started).
pub(super) fn is_unreachable(e: &str) -> bool {
    e.starts_with("replay connect")
        || e.starts_with("replay send")
        || e == "replay reply timed out (no reply at all)"
}

/// One replay request on a fresh DEALER: `["", from]`, then replies until
/// the end marker. Accepts both reply layouts.
pub(super) async fn fetch_replay(
    endpoint: String,
    from: u64,
    options: SocketOptions,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, String> {
    let mut dealer = DealerSocket::with_options(options);
    tokio::time::timeout(timeout, dealer.connect(&endpoint))
        .await
        .map_err(|_| "replay connect timed out".to_owned())?
        .map_err(|e| format!("replay connect: {e}"))?;
    let req = frames::replay_request(from);
    let msg = ZmqMessage::try_from(req.into_iter().map(Bytes::from).collect::<Vec<_>>())
        .map_err(|e| format!("{e:?}"))?;
    dealer
        .send(msg)
        .await
        .map_err(|e| format!("replay send: {e}"))?;
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(timeout, dealer.recv())
            .await
            .map_err(|_| {
                if out.is_empty() {
                    "replay reply timed out (no reply at all)".to_owned()
                } else {
                    "replay reply timed out".to_owned()
                }
            })?
            .map_err(|e| format!("replay recv: {e}"))?;
        let parts: Vec<&[u8]> = m.iter().map(Bytes::as_ref).collect();
        match frames::parse_replay_reply(&parts).map_err(|e| format!("replay reply: {e}"))? {
            ReplayReply::End => return Ok(out),
            ReplayReply::Batch { seq, payload, .. } => {
                out.push((seq, Bytes::copy_from_slice(payload)));
            }
        }
    }
}
