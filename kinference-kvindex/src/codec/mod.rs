//! The vLLM/SGLang KV-event codec: MessagePack batches ⇄ [`EventBatch`].
//!
//! Decoding accepts every form in `shared/specs/kv-events.md`: positional
//! (array) and map events, 2- and 3-element batches, hashes as u64, i64 or
//! bytes, every field added between vLLM 0.9 and 0.33 and SGLang 0.4.7 and
//! 0.5.23 (including SGLang 0.5.18's trailing `{"cache_salt": …}` map).
//! Unknown event tags and unknown fields are skipped and counted in
//! [`EventBatch::skipped`]; a malformed *known* field fails the batch with
//! [`DecodeError`]. No input panics (a proptest feeds random bytes).
//!
//! Encoding writes what vLLM writes, byte for byte (checked against the
//! fixtures): [`EncodeForm::VllmMap`] is vLLM ≥ 0.24 (map events, fields
//! that default to nil omitted when nil), [`EncodeForm::VllmArray`] is the
//! last positional form (vLLM 0.22–0.23: 12-element `BlockStored`),
//! [`EncodeForm::SglangArray`] SGLang 0.5.10–0.5.19 and
//! [`EncodeForm::SglangMap`] SGLang ≥ 0.5.20 (spec §3.4).

mod encode;
pub mod frames;
pub(crate) mod msgpack;

use crate::event::{BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, Skipped, Value};
pub use encode::encode_batch;
pub use msgpack::MsgError;
#[cfg(test)]
use msgpack::Writer;
use msgpack::{Int, Kind, Reader};

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not valid MessagePack of the expected shape.
    #[error("malformed payload")]
    Msgpack(#[from] MsgError),
    /// The batch array has fewer than 2 elements.
    #[error("batch has {0} elements, expected at least 2")]
    ShortBatch(usize),
    /// An event lacks a field that every release sends.
    #[error("{event} event lacks field {field}")]
    MissingField {
        /// Event tag.
        event: &'static str,
        /// Field name.
        field: &'static str,
    },
}

/// The wire form [`encode_batch`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodeForm {
    /// vLLM ≥ 0.24 (current): events are maps keyed by field name.
    VllmMap,
    /// vLLM 0.22–0.23, the last positional form: `BlockStored` is a
    /// 12-element array (tag + 11 fields), `BlockRemoved` 4 elements.
    VllmArray,
    /// SGLang 0.5.10–0.5.19, positional: `BlockStored` is
    /// `[tag, hashes, parent, tokens, block_size, lora_id, medium]`, plus
    /// 0.5.18's trailing `{"cache_salt": …}` map when the event has a salt;
    /// `BlockRemoved` is `[tag, hashes, medium]`. Hashes are written as
    /// signed 64-bit integers (SGLang's only form: a [`BlockHash::Uint`] is
    /// reinterpreted two's complement, bytes become [`BlockHash::id`]).
    /// SGLang 0.4.x (no `medium`) is not written.
    SglangArray,
    /// SGLang ≥ 0.5.20: map events (`type` first, `lora_id` always written,
    /// `medium`, `cache_salt`, `session_id`, `lora_name` omitted when nil),
    /// hashes as in [`EncodeForm::SglangArray`]. vLLM-only fields (groups,
    /// extra keys, locality, …) are not written.
    SglangMap,
}

/// Decodes one payload (frame 2 of a message).
///
/// # Errors
/// [`DecodeError`] when the bytes are not a batch; unknown events and
/// fields are not errors (see [`EventBatch::skipped`]).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let n = r.read_array_len()?;
    if n < 2 {
        return Err(DecodeError::ShortBatch(n));
    }
    let ts = r.read_f64()?;
    let mut skipped = Skipped::default();
    let m = if r.try_nil()? { 0 } else { r.read_array_len()? };
    let mut events = Vec::with_capacity(m);
    for _ in 0..m {
        if let Some(ev) = decode_event(&mut r, &mut skipped)? {
            events.push(ev);
        }
    }
    let mut dp_rank = None;
    if n >= 3 && !r.try_nil()? {
        dp_rank = r.read_int()?.as_i64();
    }
    for _ in 3..n {
        r.skip()?;
        skipped.unknown_fields += 1;
    }
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
        has_rank_field: n >= 3,
        skipped,
    })
}

fn decode_event(r: &mut Reader<'_>, skipped: &mut Skipped) -> Result<Option<KvEvent>, DecodeError> {
    match r.peek_kind()? {
        Kind::Array => decode_positional(r, skipped),
        Kind::Map => decode_map(r, skipped),
        _ => {
            r.skip()?;
            skipped.unknown_events += 1;
            Ok(None)
        }
    }
}

fn read_hash(r: &mut Reader<'_>) -> Result<BlockHash, MsgError> {
    // vLLM's default int mode writes uint64 (0xcf): take it directly.
    if let Some(v) = r.try_u64_marker() {
        return Ok(BlockHash::Uint(v));
    }
    if r.peek_kind()? == Kind::Bin {
        return Ok(BlockHash::Bytes(r.read_bin()?.to_vec()));
    }
    Ok(match r.read_int()? {
        Int::U(v) => BlockHash::Uint(v),
        Int::I(v) => BlockHash::Int(v),
    })
}

fn read_opt_hash(r: &mut Reader<'_>) -> Result<Option<BlockHash>, MsgError> {
    if r.try_nil()? {
        Ok(None)
    } else {
        read_hash(r).map(Some)
    }
}

fn read_hashes(r: &mut Reader<'_>) -> Result<Vec<BlockHash>, MsgError> {
    if r.try_nil()? {
        return Ok(Vec::new());
    }
    let n = r.read_array_len()?;
    let mut v = Vec::with_capacity(n);
    // vLLM's default: every hash a uint64 (0xcf); the rest one by one.
    r.read_u64_run(n, |h| v.push(BlockHash::Uint(h)));
    while v.len() < n {
        v.push(read_hash(r)?);
    }
    Ok(v)
}

fn read_tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, MsgError> {
    if r.try_nil()? {
        return Ok(Vec::new());
    }
    let n = r.read_array_len()?;
    let mut v = Vec::with_capacity(n);
    r.read_u32s(n, &mut v)?;
    Ok(v)
}

fn read_u32_or_zero(r: &mut Reader<'_>) -> Result<u32, MsgError> {
    if r.try_nil()? { Ok(0) } else { r.read_u32() }
}

/// Optional scalar fields are lenient: a value of an unexpected type is
/// skipped and counted instead of failing the batch.
fn opt_str(r: &mut Reader<'_>, skipped: &mut Skipped) -> Result<Option<String>, MsgError> {
    match r.peek_kind()? {
        Kind::Nil => {
            r.skip()?;
            Ok(None)
        }
        Kind::Str => Ok(Some(r.read_str()?.to_owned())),
        _ => {
            r.skip()?;
            skipped.unknown_fields += 1;
            Ok(None)
        }
    }
}

fn opt_int(r: &mut Reader<'_>, skipped: &mut Skipped) -> Result<Option<i64>, MsgError> {
    match r.peek_kind()? {
        Kind::Int => Ok(r.read_int()?.as_i64()),
        Kind::Nil => {
            r.skip()?;
            Ok(None)
        }
        _ => {
            r.skip()?;
            skipped.unknown_fields += 1;
            Ok(None)
        }
    }
}

fn opt_u32(r: &mut Reader<'_>, skipped: &mut Skipped) -> Result<Option<u32>, MsgError> {
    Ok(opt_int(r, skipped)?.and_then(|v| u32::try_from(v).ok()))
}

fn read_extra_keys(
    r: &mut Reader<'_>,
    skipped: &mut Skipped,
) -> Result<Option<Vec<Option<Vec<Value>>>>, MsgError> {
    match r.peek_kind()? {
        Kind::Nil => {
            r.skip()?;
            Ok(None)
        }
        Kind::Array => {
            let n = r.read_array_len()?;
            // What vLLM sends for blocks without extras: a nil per block.
            if r.skip_nil_run(n) {
                return Ok(Some(vec![None; n]));
            }
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                if r.try_nil()? {
                    out.push(None);
                    continue;
                }
                match r.read_value()? {
                    Value::Nil => out.push(None),
                    Value::Array(items) => out.push(Some(items)),
                    _ => {
                        skipped.unknown_fields += 1;
                        out.push(None);
                    }
                }
            }
            Ok(Some(out))
        }
        _ => {
            r.skip()?;
            skipped.unknown_fields += 1;
            Ok(None)
        }
    }
}

fn read_lookahead(
    r: &mut Reader<'_>,
    skipped: &mut Skipped,
) -> Result<Option<Vec<Vec<u32>>>, MsgError> {
    match r.peek_kind()? {
        Kind::Nil => {
            r.skip()?;
            Ok(None)
        }
        Kind::Array => {
            let n = r.read_array_len()?;
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push(read_tokens(r)?);
            }
            Ok(Some(out))
        }
        _ => {
            r.skip()?;
            skipped.unknown_fields += 1;
            Ok(None)
        }
    }
}

/// SGLang 0.5.18–0.5.19's trailing metadata map: `{"cache_salt": …}`.
fn read_metadata(
    r: &mut Reader<'_>,
    ev: &mut BlockStored,
    skipped: &mut Skipped,
) -> Result<(), MsgError> {
    let n = r.read_map_len()?;
    for _ in 0..n {
        if r.peek_kind()? == Kind::Str && r.clone().read_str()? == "cache_salt" {
            r.read_str()?;
            ev.cache_salt = opt_str(r, skipped)?;
        } else {
            r.skip()?;
            r.skip()?;
            skipped.unknown_fields += 1;
        }
    }
    Ok(())
}

fn decode_positional(
    r: &mut Reader<'_>,
    skipped: &mut Skipped,
) -> Result<Option<KvEvent>, DecodeError> {
    let n = r.read_array_len()?;
    if n == 0 {
        skipped.unknown_events += 1;
        return Ok(None);
    }
    if r.peek_kind()? != Kind::Str {
        for _ in 0..n {
            r.skip()?;
        }
        skipped.unknown_events += 1;
        return Ok(None);
    }
    let tag = r.read_str()?;
    match tag {
        "BlockStored" => {
            const EV: &str = "BlockStored";
            if n < 5 {
                return Err(DecodeError::MissingField {
                    event: EV,
                    field: "block_size",
                });
            }
            let mut ev = BlockStored {
                block_hashes: read_hashes(r)?,
                parent_block_hash: read_opt_hash(r)?,
                token_ids: read_tokens(r)?,
                block_size: read_u32_or_zero(r)?,
                ..BlockStored::default()
            };
            for i in 5..n {
                match i {
                    5 => ev.lora_id = opt_int(r, skipped)?,
                    6 => ev.medium = opt_str(r, skipped)?,
                    7 if r.peek_kind()? == Kind::Map => read_metadata(r, &mut ev, skipped)?,
                    7 => ev.lora_name = opt_str(r, skipped)?,
                    8 => ev.extra_keys = read_extra_keys(r, skipped)?,
                    9 => ev.group_idx = opt_u32(r, skipped)?,
                    10 => ev.kv_cache_spec_kind = opt_str(r, skipped)?,
                    11 => ev.kv_cache_spec_sliding_window = opt_u32(r, skipped)?,
                    _ => {
                        r.skip()?;
                        skipped.unknown_fields += 1;
                    }
                }
            }
            Ok(Some(KvEvent::BlockStored(ev)))
        }
        "BlockRemoved" => {
            if n < 2 {
                return Err(DecodeError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                });
            }
            let mut ev = BlockRemoved {
                block_hashes: read_hashes(r)?,
                ..BlockRemoved::default()
            };
            for i in 2..n {
                match i {
                    2 => ev.medium = opt_str(r, skipped)?,
                    3 => ev.group_idx = opt_u32(r, skipped)?,
                    _ => {
                        r.skip()?;
                        skipped.unknown_fields += 1;
                    }
                }
            }
            Ok(Some(KvEvent::BlockRemoved(ev)))
        }
        "AllBlocksCleared" => {
            for _ in 1..n {
                r.skip()?;
                skipped.unknown_fields += 1;
            }
            Ok(Some(KvEvent::AllBlocksCleared))
        }
        _ => {
            for _ in 1..n {
                r.skip()?;
            }
            skipped.unknown_events += 1;
            Ok(None)
        }
    }
}

fn decode_map(r: &mut Reader<'_>, skipped: &mut Skipped) -> Result<Option<KvEvent>, DecodeError> {
    let n = r.read_map_len()?;
    // Find the tag first: do not rely on key order.
    let mut tag = None;
    let mut probe = r.clone();
    for _ in 0..n {
        if probe.peek_kind()? == Kind::Str {
            if probe.read_str()? == "type" {
                if probe.peek_kind()? == Kind::Str {
                    tag = Some(probe.read_str()?);
                }
                break;
            }
        } else {
            probe.skip()?;
        }
        probe.skip()?;
    }
    let kind = match tag {
        Some("BlockStored") => 1,
        Some("BlockRemoved") => 2,
        Some("AllBlocksCleared") => 3,
        _ => 0,
    };
    let mut stored = BlockStored::default();
    let mut removed = BlockRemoved::default();
    let (mut has_hashes, mut has_size) = (false, false);
    for _ in 0..n {
        if r.peek_kind()? != Kind::Str {
            r.skip()?;
            r.skip()?;
            skipped.unknown_fields += 1;
            continue;
        }
        // Keys are compared as bytes: a key that is not UTF-8 is unknown.
        let key = r.read_str_bytes()?;
        match (kind, key) {
            (_, b"type") | (0, _) => r.skip()?,
            (1, b"block_hashes") => {
                stored.block_hashes = read_hashes(r)?;
                has_hashes = true;
            }
            (1, b"parent_block_hash") => stored.parent_block_hash = read_opt_hash(r)?,
            (1, b"token_ids") => stored.token_ids = read_tokens(r)?,
            (1, b"block_size") => {
                stored.block_size = read_u32_or_zero(r)?;
                has_size = true;
            }
            (1, b"lora_id") => stored.lora_id = opt_int(r, skipped)?,
            (1, b"medium") => stored.medium = opt_str(r, skipped)?,
            (1, b"lora_name") => stored.lora_name = opt_str(r, skipped)?,
            (1, b"extra_keys") => stored.extra_keys = read_extra_keys(r, skipped)?,
            (1, b"group_idx") => stored.group_idx = opt_u32(r, skipped)?,
            (1, b"kv_cache_spec_kind") => stored.kv_cache_spec_kind = opt_str(r, skipped)?,
            (1, b"kv_cache_spec_sliding_window") => {
                stored.kv_cache_spec_sliding_window = opt_u32(r, skipped)?;
            }
            (1, b"locality") => stored.locality = opt_str(r, skipped)?,
            (1, b"ownership") => stored.ownership = opt_str(r, skipped)?,
            (1, b"session_id") => stored.session_id = opt_str(r, skipped)?,
            (1, b"lookahead_token_ids") => stored.lookahead_token_ids = read_lookahead(r, skipped)?,
            (1, b"cache_salt") => stored.cache_salt = opt_str(r, skipped)?,
            (2, b"block_hashes") => {
                removed.block_hashes = read_hashes(r)?;
                has_hashes = true;
            }
            (2, b"medium") => removed.medium = opt_str(r, skipped)?,
            (2, b"group_idx") => removed.group_idx = opt_u32(r, skipped)?,
            (2, b"locality") => removed.locality = opt_str(r, skipped)?,
            (2, b"ownership") => removed.ownership = opt_str(r, skipped)?,
            _ => {
                r.skip()?;
                skipped.unknown_fields += 1;
            }
        }
    }
    match kind {
        1 => {
            if !has_hashes {
                return Err(DecodeError::MissingField {
                    event: "BlockStored",
                    field: "block_hashes",
                });
            }
            if !has_size {
                return Err(DecodeError::MissingField {
                    event: "BlockStored",
                    field: "block_size",
                });
            }
            Ok(Some(KvEvent::BlockStored(stored)))
        }
        2 => {
            if !has_hashes {
                return Err(DecodeError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                });
            }
            Ok(Some(KvEvent::BlockRemoved(removed)))
        }
        3 => Ok(Some(KvEvent::AllBlocksCleared)),
        _ => {
            skipped.unknown_events += 1;
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_event_tags_and_fields_are_counted_not_fatal() {
        let mut w = Writer::default();
        w.array(4);
        w.f64(1.0);
        w.array(3);
        // unknown positional tag
        w.array(2);
        w.str("BlockPinned");
        w.uint(5);
        // map event with an unknown key
        w.map(4);
        w.str("type");
        w.str("BlockRemoved");
        w.str("block_hashes");
        w.array(1);
        w.int(-5);
        w.str("medium");
        w.nil();
        w.str("future_field");
        w.uint(1);
        // not an event at all
        w.uint(7);
        w.uint(0);
        w.str("trailing batch element");
        let b = decode_batch(w.bytes()).expect("decodes");
        assert_eq!(b.events.len(), 1);
        assert_eq!(b.skipped.unknown_events, 2);
        assert_eq!(b.skipped.unknown_fields, 2);
        assert_eq!(b.dp_rank, Some(0));
        let KvEvent::BlockRemoved(rm) = &b.events[0] else {
            panic!("expected BlockRemoved")
        };
        assert_eq!(rm.block_hashes[0].id(), (-5i64) as u64);
    }

    #[test]
    fn missing_core_fields_fail_the_batch() {
        let mut w = Writer::default();
        w.array(2);
        w.f64(1.0);
        w.array(1);
        w.map(1);
        w.str("type");
        w.str("BlockStored");
        assert!(matches!(
            decode_batch(w.bytes()),
            Err(DecodeError::MissingField {
                field: "block_hashes",
                ..
            })
        ));
        assert!(matches!(
            decode_batch(&[0x91, 0xcb]),
            Err(DecodeError::ShortBatch(1))
        ));
    }

    /// The runs the decoder takes whole (uint64 hashes, nil extra keys)
    /// end where another form starts, and the rest is read as before.
    #[test]
    fn hash_and_nil_runs_stop_at_other_forms() {
        let mut w = Writer::default();
        w.array(3);
        w.f64(1.0);
        w.array(2);
        w.map(4);
        w.str("type");
        w.str("BlockStored");
        w.str("block_hashes");
        w.array(5);
        w.uint(1 << 40);
        w.uint(u64::MAX);
        w.uint(7); // fixint: ends the run
        w.int(-3);
        w.bin(&[1, 2]);
        w.str("block_size");
        w.uint(16);
        w.str("extra_keys");
        w.array(4);
        w.nil();
        w.nil();
        w.array(1);
        w.str("salt");
        w.nil();
        w.map(4);
        w.str("type");
        w.str("BlockStored");
        w.str("block_hashes");
        w.array(0);
        w.str("block_size");
        w.uint(16);
        w.str("extra_keys");
        w.array(19);
        for _ in 0..19 {
            w.nil();
        }
        // The rank, nil: one more nil than the list holds is not eaten.
        w.nil();
        let b = decode_batch(w.bytes()).expect("decodes");
        assert!(b.has_rank_field);
        assert_eq!(b.dp_rank, None);
        let [KvEvent::BlockStored(a), KvEvent::BlockStored(c)] = &b.events[..] else {
            panic!("two stores: {:?}", b.events)
        };
        assert_eq!(
            a.block_hashes,
            [
                BlockHash::Uint(1 << 40),
                BlockHash::Uint(u64::MAX),
                BlockHash::Uint(7),
                BlockHash::Int(-3),
                BlockHash::Bytes(vec![1, 2]),
            ]
        );
        assert_eq!(
            a.extra_keys,
            Some(vec![
                None,
                None,
                Some(vec![Value::Str("salt".into())]),
                None
            ])
        );
        assert_eq!(c.extra_keys, Some(vec![None; 19]));
        assert!(c.block_hashes.is_empty());
        // A list cut inside its nils is an error, not a shorter list.
        let cut = &w.bytes()[..w.bytes().len() - 5];
        assert!(decode_batch(cut).is_err());
    }

    #[test]
    fn hash_ids_normalise_ints_and_bytes() {
        assert_eq!(BlockHash::Int(-1).id(), u64::MAX);
        let mut b = vec![0u8; 32];
        b[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(BlockHash::Bytes(b).id(), 0x0102_0304_0506_0708);
        assert_eq!(BlockHash::Bytes(vec![1, 2]).id(), 0x0102);
    }
}
