//! The encoder: [`EventBatch`] → the bytes an engine's publisher writes,
//! in one of the [`EncodeForm`]s (on `rmp`'s encoders, see `msgpack`).

use super::EncodeForm;
use super::msgpack::Writer;
use crate::event::{BlockHash, EventBatch, KvEvent, Value};

fn write_hash(w: &mut Writer, h: &BlockHash) {
    match h {
        BlockHash::Uint(v) => w.uint(*v),
        BlockHash::Int(v) => w.int(*v),
        BlockHash::Bytes(b) => w.bin(b),
    }
}

fn write_opt_str(w: &mut Writer, s: Option<&str>) {
    match s {
        Some(s) => w.str(s),
        None => w.nil(),
    }
}

fn write_opt_int(w: &mut Writer, v: Option<i64>) {
    match v {
        Some(v) => w.int(v),
        None => w.nil(),
    }
}

fn write_hashes(w: &mut Writer, hs: &[BlockHash]) {
    w.array(hs.len());
    for h in hs {
        write_hash(w, h);
    }
}

fn write_tokens(w: &mut Writer, ts: &[u32]) {
    w.array(ts.len());
    for t in ts {
        w.uint(u64::from(*t));
    }
}

fn write_extra_keys(w: &mut Writer, ek: Option<&Vec<Option<Vec<Value>>>>) {
    match ek {
        None => w.nil(),
        Some(list) => {
            w.array(list.len());
            for e in list {
                match e {
                    None => w.nil(),
                    Some(items) => {
                        w.array(items.len());
                        for it in items {
                            w.value(it);
                        }
                    }
                }
            }
        }
    }
}

/// Encodes a batch the way the engine's publisher does (`msgspec`
/// encoder), byte for byte.
///
/// The batch is always the 3-element `[ts, events, rank]` array. Fields a
/// form does not have are not written (e.g. `locality` in the array form,
/// SGLang's `cache_salt` in the vLLM forms, vLLM's groups in the SGLang
/// forms).
pub fn encode_batch(batch: &EventBatch, form: EncodeForm) -> Vec<u8> {
    let mut w = Writer::with_capacity(64 + batch.events.len() * 256);
    w.array(3);
    w.f64(batch.ts);
    w.array(batch.events.len());
    for ev in &batch.events {
        match form {
            EncodeForm::VllmMap => encode_map_event(&mut w, ev),
            EncodeForm::VllmArray => encode_array_event(&mut w, ev),
            EncodeForm::SglangArray => encode_sglang_array_event(&mut w, ev),
            EncodeForm::SglangMap => encode_sglang_map_event(&mut w, ev),
        }
    }
    write_opt_int(&mut w, batch.dp_rank);
    w.into_vec()
}

fn encode_array_event(w: &mut Writer, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored(s) => {
            w.array(12);
            w.str("BlockStored");
            write_hashes(w, &s.block_hashes);
            match &s.parent_block_hash {
                Some(h) => write_hash(w, h),
                None => w.nil(),
            }
            write_tokens(w, &s.token_ids);
            w.uint(u64::from(s.block_size));
            write_opt_int(w, s.lora_id);
            write_opt_str(w, s.medium.as_deref());
            write_opt_str(w, s.lora_name.as_deref());
            write_extra_keys(w, s.extra_keys.as_ref());
            write_opt_int(w, s.group_idx.map(i64::from));
            write_opt_str(w, s.kv_cache_spec_kind.as_deref());
            write_opt_int(w, s.kv_cache_spec_sliding_window.map(i64::from));
        }
        KvEvent::BlockRemoved(rm) => {
            w.array(4);
            w.str("BlockRemoved");
            write_hashes(w, &rm.block_hashes);
            write_opt_str(w, rm.medium.as_deref());
            write_opt_int(w, rm.group_idx.map(i64::from));
        }
        KvEvent::AllBlocksCleared => {
            w.array(1);
            w.str("AllBlocksCleared");
        }
    }
}

/// SGLang publishes every hash as a signed 64-bit integer.
fn write_signed_hash(w: &mut Writer, h: &BlockHash) {
    w.int(h.id() as i64);
}

fn write_signed_hashes(w: &mut Writer, hs: &[BlockHash]) {
    w.array(hs.len());
    for h in hs {
        write_signed_hash(w, h);
    }
}

fn encode_sglang_array_event(w: &mut Writer, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored(s) => {
            w.array(if s.cache_salt.is_some() { 8 } else { 7 });
            w.str("BlockStored");
            write_signed_hashes(w, &s.block_hashes);
            match &s.parent_block_hash {
                Some(h) => write_signed_hash(w, h),
                None => w.nil(),
            }
            write_tokens(w, &s.token_ids);
            w.uint(u64::from(s.block_size));
            write_opt_int(w, s.lora_id);
            write_opt_str(w, s.medium.as_deref());
            if let Some(salt) = &s.cache_salt {
                w.map(1);
                w.str("cache_salt");
                w.str(salt);
            }
        }
        KvEvent::BlockRemoved(rm) => {
            w.array(3);
            w.str("BlockRemoved");
            write_signed_hashes(w, &rm.block_hashes);
            write_opt_str(w, rm.medium.as_deref());
        }
        KvEvent::AllBlocksCleared => {
            w.array(1);
            w.str("AllBlocksCleared");
        }
    }
}

fn encode_sglang_map_event(w: &mut Writer, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored(s) => {
            // `type` and the five fields without a default are always
            // written; the four with a default are omitted when nil. Ten
            // possible entries: a fixmap header.
            let optional = [
                s.medium.as_deref(),
                s.cache_salt.as_deref(),
                s.session_id.as_deref(),
                s.lora_name.as_deref(),
            ];
            w.map(6 + optional.iter().filter(|x| x.is_some()).count());
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            write_signed_hashes(w, &s.block_hashes);
            w.str("parent_block_hash");
            match &s.parent_block_hash {
                Some(h) => write_signed_hash(w, h),
                None => w.nil(),
            }
            w.str("token_ids");
            write_tokens(w, &s.token_ids);
            w.str("block_size");
            w.uint(u64::from(s.block_size));
            w.str("lora_id");
            write_opt_int(w, s.lora_id);
            for (name, v) in ["medium", "cache_salt", "session_id", "lora_name"]
                .into_iter()
                .zip(optional)
            {
                if let Some(v) = v {
                    w.str(name);
                    w.str(v);
                }
            }
        }
        KvEvent::BlockRemoved(rm) => {
            w.map(2 + usize::from(rm.medium.is_some()));
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            write_signed_hashes(w, &rm.block_hashes);
            if let Some(m) = &rm.medium {
                w.str("medium");
                w.str(m);
            }
        }
        KvEvent::AllBlocksCleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
    }
}

fn encode_map_event(w: &mut Writer, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored(s) => {
            // Fields 1–7 have no default (always written); 8+ are omitted
            // when nil (msgspec `omit_defaults`).
            let optional = [
                s.extra_keys.is_some(),
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
                s.locality.is_some(),
                s.ownership.is_some(),
                s.session_id.is_some(),
                s.lookahead_token_ids.is_some(),
            ];
            // vLLM 0.33's BlockStored has 16 possible entries, so msgspec
            // always writes the 3-byte map header.
            w.map16(8 + optional.iter().filter(|x| **x).count());
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            write_hashes(w, &s.block_hashes);
            w.str("parent_block_hash");
            match &s.parent_block_hash {
                Some(h) => write_hash(w, h),
                None => w.nil(),
            }
            w.str("token_ids");
            write_tokens(w, &s.token_ids);
            w.str("block_size");
            w.uint(u64::from(s.block_size));
            w.str("lora_id");
            write_opt_int(w, s.lora_id);
            w.str("medium");
            write_opt_str(w, s.medium.as_deref());
            w.str("lora_name");
            write_opt_str(w, s.lora_name.as_deref());
            if s.extra_keys.is_some() {
                w.str("extra_keys");
                write_extra_keys(w, s.extra_keys.as_ref());
            }
            if let Some(g) = s.group_idx {
                w.str("group_idx");
                w.uint(u64::from(g));
            }
            if let Some(k) = &s.kv_cache_spec_kind {
                w.str("kv_cache_spec_kind");
                w.str(k);
            }
            if let Some(sw) = s.kv_cache_spec_sliding_window {
                w.str("kv_cache_spec_sliding_window");
                w.uint(u64::from(sw));
            }
            if let Some(l) = &s.locality {
                w.str("locality");
                w.str(l);
            }
            if let Some(o) = &s.ownership {
                w.str("ownership");
                w.str(o);
            }
            if let Some(sid) = &s.session_id {
                w.str("session_id");
                w.str(sid);
            }
            if let Some(la) = &s.lookahead_token_ids {
                w.str("lookahead_token_ids");
                w.array(la.len());
                for t in la {
                    write_tokens(w, t);
                }
            }
        }
        KvEvent::BlockRemoved(rm) => {
            let optional = [
                rm.group_idx.is_some(),
                rm.locality.is_some(),
                rm.ownership.is_some(),
            ];
            w.map(3 + optional.iter().filter(|x| **x).count());
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            write_hashes(w, &rm.block_hashes);
            w.str("medium");
            write_opt_str(w, rm.medium.as_deref());
            if let Some(g) = rm.group_idx {
                w.str("group_idx");
                w.uint(u64::from(g));
            }
            if let Some(l) = &rm.locality {
                w.str("locality");
                w.str(l);
            }
            if let Some(o) = &rm.ownership {
                w.str("ownership");
                w.str(o);
            }
        }
        KvEvent::AllBlocksCleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
    }
}
