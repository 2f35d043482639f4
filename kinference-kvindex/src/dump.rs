//! Events as JSON lines, one event per line: what `kvdump decode` and
//! `kvdump watch` print (and the router's `events` command will).
//!
//! Fields: `worker` and `seq` when known, `type`, `block_hashes` (integers
//! as decimal JSON numbers, bytes as lower-case hex strings),
//! `parent_block_hash`, `token_ids`, `block_size`, `medium`, `lora_name`;
//! plus `group_idx` and `dp_rank` when present.

use serde_json::{Map, Value as Json, json};

use crate::event::{BlockHash, EventBatch, KvEvent};

fn hash_json(h: &BlockHash) -> Json {
    match h {
        BlockHash::Uint(v) => json!(v),
        BlockHash::Int(v) => json!(v),
        BlockHash::Bytes(b) => Json::String(hex(b)),
    }
}

/// Lower-case hex of bytes.
pub fn hex(b: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(char::from(D[usize::from(x >> 4)]));
        s.push(char::from(D[usize::from(x & 15)]));
    }
    s
}

/// One JSON object per event of the batch.
pub fn batch_json(batch: &EventBatch, worker: Option<&str>, seq: Option<u64>) -> Vec<Json> {
    batch
        .events
        .iter()
        .map(|ev| {
            let mut m = Map::new();
            if let Some(w) = worker {
                m.insert("worker".into(), json!(w));
            }
            if let Some(s) = seq {
                m.insert("seq".into(), json!(s));
            }
            m.insert("type".into(), json!(ev.tag()));
            match ev {
                KvEvent::BlockStored(s) => {
                    m.insert(
                        "block_hashes".into(),
                        s.block_hashes.iter().map(hash_json).collect(),
                    );
                    m.insert(
                        "parent_block_hash".into(),
                        s.parent_block_hash.as_ref().map_or(Json::Null, hash_json),
                    );
                    m.insert("token_ids".into(), json!(s.token_ids));
                    m.insert("block_size".into(), json!(s.block_size));
                    m.insert("medium".into(), json!(s.medium));
                    m.insert("lora_name".into(), json!(s.lora_name));
                    if let Some(g) = s.group_idx {
                        m.insert("group_idx".into(), json!(g));
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    m.insert(
                        "block_hashes".into(),
                        r.block_hashes.iter().map(hash_json).collect(),
                    );
                    m.insert("medium".into(), json!(r.medium));
                    if let Some(g) = r.group_idx {
                        m.insert("group_idx".into(), json!(g));
                    }
                }
                KvEvent::AllBlocksCleared => {}
            }
            if let Some(r) = batch.dp_rank {
                m.insert("dp_rank".into(), json!(r));
            }
            Json::Object(m)
        })
        .collect()
}

/// The batch as newline-terminated JSON lines.
pub fn batch_lines(batch: &EventBatch, worker: Option<&str>, seq: Option<u64>) -> String {
    let mut out = String::new();
    for v in batch_json(batch, worker, seq) {
        out.push_str(&v.to_string());
        out.push('\n');
    }
    out
}

/// Lines for one payload; an undecodable payload gives one `error` line.
pub fn payload_lines(payload: &[u8], worker: Option<&str>, seq: Option<u64>) -> String {
    match crate::codec::decode_batch(payload) {
        Ok(b) => batch_lines(&b, worker, seq),
        Err(e) => format!(
            "{}\n",
            json!({"worker": worker, "seq": seq, "error": e.to_string()})
        ),
    }
}

/// Lines for a file: a `.frames` capture (a live message, or a replay reply
/// with its end marker) when `name` ends in `.frames`, else one `.msgpack`
/// batch payload.
///
/// # Errors
/// A `.frames` file that is not a valid capture.
pub fn decode_file(name: &str, bytes: &[u8]) -> Result<String, crate::codec::frames::FrameError> {
    use crate::codec::frames::{self, ReplayReply};
    if !std::path::Path::new(name)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("frames"))
    {
        return Ok(payload_lines(bytes, None, None));
    }
    let f = frames::read_frames_container(bytes)?;
    if let Ok(m) = frames::parse_live(&f) {
        let topic = String::from_utf8_lossy(m.topic);
        return Ok(payload_lines(
            m.payload,
            (!topic.is_empty()).then_some(&*topic),
            Some(m.seq),
        ));
    }
    Ok(match frames::parse_replay_reply(&f)? {
        ReplayReply::Batch {
            topic,
            seq,
            payload,
        } => {
            let topic = topic.map(String::from_utf8_lossy).filter(|t| !t.is_empty());
            payload_lines(payload, topic.as_deref(), Some(seq))
        }
        ReplayReply::End => format!("{}\n", json!({"type": "end_of_replay"})),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::BlockStored;

    #[test]
    fn ints_stay_exact_and_bytes_are_hex() {
        let b = EventBatch {
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![
                    BlockHash::Uint(u64::MAX),
                    BlockHash::Int(-2),
                    BlockHash::Bytes(vec![0xab, 1]),
                ],
                block_size: 16,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        };
        let line = batch_lines(&b, Some("w0"), Some(3));
        assert!(
            line.contains("[18446744073709551615,-2,\"ab01\"]"),
            "{line}"
        );
        assert!(
            line.starts_with("{\"worker\":\"w0\",\"seq\":3,\"type\":\"BlockStored\""),
            "{line}"
        );
    }
}
