//! A second KV-event decoder, on serde over borrowed bytes (`rmp-serde`),
//! as the design card names it: the reference the fuzzer checks the
//! crate's hand-written decoder against, and the comparison the benchmarks
//! time (`benches/README.md`: rmp-serde does not reach the decode goal, so
//! the crate decodes with its own reader). Included by `tests/fuzz.rs` and
//! the benches with `#[path]`.
//!
//! The wire types are serde `Deserialize` implementations driven by
//! `rmp_serde::Deserializer::from_read_ref`, so strings are borrowed from
//! the payload until an event keeps them. Scalars and lists use serde's own
//! impls (`u32`, `Vec<u32>`, `&str`); the event itself is a visitor, not a
//! derived struct, because the wire has two shapes per event (a positional
//! array whose length says the release, a map keyed by field name with the
//! `type` key anywhere) and because unknown fields must be *counted*, which
//! a derived struct cannot do (it drops them silently, or, for arrays,
//! fails on extra elements).
//!
//! Leniency as the spec asks: unknown event tags and fields are skipped and
//! counted; an optional scalar of an unexpected type is skipped and
//! counted; a malformed *required* field fails the batch.

use std::fmt;

use serde::de::{
    self, Deserialize as _, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess,
    Visitor,
};

use kinference_kvindex::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Skipped};

mod fields;
use fields::{
    ExtraKeys, Field7, Hashes, Lenient, Lookahead, OptHash, Size, Tokens, extra_keys, lenient,
    lenient_str, map_lenient, map_lenient_str,
};

/// Deepest nesting followed (hostile input cannot exhaust the stack).
const MAX_DEPTH: usize = 32;

/// Why a payload did not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Not MessagePack of the expected shape (rmp-serde's message).
    Msgpack(String),
    /// The batch has fewer than 2 elements.
    ShortBatch(usize),
    /// An event lacks a field every release sends.
    MissingField {
        event: &'static str,
        field: &'static str,
    },
    /// A field every release sends has the wrong type or range.
    MalformedField {
        event: &'static str,
        field: &'static str,
    },
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_DEPTH);
    let mut problem = None;
    let seed = BatchSeed {
        problem: &mut problem,
    };
    match seed.deserialize(&mut de) {
        Ok(b) => Ok(b),
        Err(e) => Err(problem.unwrap_or_else(|| DecodeError::Msgpack(e.to_string()))),
    }
}

struct BatchSeed<'p> {
    problem: &'p mut Option<DecodeError>,
}

impl<'de> DeserializeSeed<'de> for BatchSeed<'_> {
    type Value = EventBatch;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<EventBatch, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed<'_> {
    type Value = EventBatch;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event batch [ts, events, rank]")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventBatch, A::Error> {
        let n = seq.size_hint().unwrap_or(0);
        if n < 2 {
            *self.problem = Some(DecodeError::ShortBatch(n));
            return Err(de::Error::custom("short batch"));
        }
        let mut skipped = Skipped::default();
        let ts = seq.next_element::<Ts>()?.map_or(0.0, |t| t.0);
        let events = seq
            .next_element_seed(EventsSeed {
                skipped: &mut skipped,
                problem: self.problem,
            })?
            .unwrap_or_default();
        let mut dp_rank = None;
        if n >= 3 {
            dp_rank = seq.next_element::<Int>()?.and_then(|i| i.0);
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {
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
}

/// `ts`: a float, or an integer read as one.
struct Ts(f64);

impl<'de> de::Deserialize<'de> for Ts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ts, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Ts;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a timestamp")
            }
            fn visit_f64<E>(self, v: f64) -> Result<Ts, E> {
                Ok(Ts(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Ts, E> {
                Ok(Ts(v as f64))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Ts, E> {
                Ok(Ts(v as f64))
            }
        }
        d.deserialize_any(V)
    }
}

/// An optional integer: nil is `None`; anything else must be an integer
/// that fits i64.
struct Int(Option<i64>);

impl<'de> de::Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Int, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer or nil")
            }
            fn visit_unit<E>(self) -> Result<Int, E> {
                Ok(Int(None))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Int, E> {
                Ok(Int(Some(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Int, E> {
                Ok(Int(i64::try_from(v).ok()))
            }
        }
        d.deserialize_any(V)
    }
}

struct EventsSeed<'a> {
    skipped: &'a mut Skipped,
    problem: &'a mut Option<DecodeError>,
}

impl<'de> DeserializeSeed<'de> for EventsSeed<'_> {
    type Value = Vec<KvEvent>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<KvEvent>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventsSeed<'_> {
    type Value = Vec<KvEvent>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of events")
    }
    fn visit_unit<E>(self) -> Result<Vec<KvEvent>, E> {
        Ok(Vec::new())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<KvEvent>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(ev) = seq.next_element_seed(EventSeed {
            skipped: self.skipped,
            problem: self.problem,
        })? {
            if let Some(ev) = ev {
                out.push(ev);
            }
        }
        Ok(out)
    }
}

struct EventSeed<'a> {
    skipped: &'a mut Skipped,
    problem: &'a mut Option<DecodeError>,
}

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = Option<KvEvent>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<KvEvent>, D::Error> {
        d.deserialize_any(self)
    }
}

impl EventSeed<'_> {
    fn missing<E: de::Error>(self, event: &'static str, field: &'static str) -> E {
        *self.problem = Some(DecodeError::MissingField { event, field });
        E::custom("missing field")
    }
    fn malformed<E: de::Error>(self, event: &'static str, field: &'static str) -> E {
        *self.problem = Some(DecodeError::MalformedField { event, field });
        E::custom("malformed field")
    }
    #[allow(clippy::unnecessary_wraps)] // the visitors' return type
    fn not_an_event<E>(self) -> Result<Option<KvEvent>, E> {
        self.skipped.unknown_events += 1;
        Ok(None)
    }
}

/// Anything that is not an array or a map is not an event.
macro_rules! not_an_event {
    ($($f:ident: $t:ty),*) => {
        $(fn $f<E: de::Error>(self, _: $t) -> Result<Option<KvEvent>, E> {
            self.not_an_event()
        })*
    };
}

impl<'de> Visitor<'de> for EventSeed<'_> {
    type Value = Option<KvEvent>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event (array or map)")
    }
    not_an_event!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64,
        visit_str: &str, visit_bytes: &[u8]);
    fn visit_unit<E: de::Error>(self) -> Result<Option<KvEvent>, E> {
        self.not_an_event()
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Option<KvEvent>, D::Error> {
        IgnoredAny::deserialize(d)?;
        self.not_an_event()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<KvEvent>, A::Error> {
        let n = seq.size_hint().unwrap_or(0);
        let Some(Lenient::Ok(tag)) = seq.next_element::<Lenient<&'de str>>()? else {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return self.not_an_event();
        };
        let sk = &mut *self.skipped;
        let ev = match tag {
            "BlockStored" => {
                const EV: &str = "BlockStored";
                if n < 5 {
                    return Err(self.missing(EV, "block_size"));
                }
                let Some(block_hashes) = seq.next_element::<Hashes>()?.and_then(|h| h.0.0) else {
                    return Err(self.malformed(EV, "block_hashes"));
                };
                let Some(parent_block_hash) = seq.next_element::<OptHash>()?.and_then(|h| h.0.0)
                else {
                    return Err(self.malformed(EV, "parent_block_hash"));
                };
                let Some(token_ids) = seq.next_element::<Tokens>()?.and_then(|t| t.0.0) else {
                    return Err(self.malformed(EV, "token_ids"));
                };
                let Some(block_size) = seq.next_element::<Size>()?.and_then(|s| s.0.0) else {
                    return Err(self.malformed(EV, "block_size"));
                };
                let mut ev = BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..BlockStored::default()
                };
                for i in 5..n {
                    match i {
                        5 => ev.lora_id = lenient(&mut seq, sk)?,
                        6 => ev.medium = lenient_str(&mut seq, sk)?,
                        // SGLang 0.5.18–0.5.19: a trailing metadata map.
                        7 => match seq.next_element::<Field7<'de>>()? {
                            Some(Field7::Str(s)) => ev.lora_name = Some(s.to_owned()),
                            Some(Field7::Salt(s, extra)) => {
                                ev.cache_salt = s.map(str::to_owned);
                                sk.unknown_fields += extra;
                            }
                            Some(Field7::Nil) | None => {}
                            Some(Field7::Other) => sk.unknown_fields += 1,
                        },
                        8 => ev.extra_keys = extra_keys(&mut seq, sk)?,
                        9 => ev.group_idx = lenient(&mut seq, sk)?,
                        10 => ev.kv_cache_spec_kind = lenient_str(&mut seq, sk)?,
                        11 => ev.kv_cache_spec_sliding_window = lenient(&mut seq, sk)?,
                        _ => {
                            seq.next_element::<IgnoredAny>()?;
                            sk.unknown_fields += 1;
                        }
                    }
                }
                KvEvent::BlockStored(ev)
            }
            "BlockRemoved" => {
                if n < 2 {
                    return Err(self.missing("BlockRemoved", "block_hashes"));
                }
                let Some(block_hashes) = seq.next_element::<Hashes>()?.and_then(|h| h.0.0) else {
                    return Err(self.malformed("BlockRemoved", "block_hashes"));
                };
                let mut ev = BlockRemoved {
                    block_hashes,
                    ..BlockRemoved::default()
                };
                for i in 2..n {
                    match i {
                        2 => ev.medium = lenient_str(&mut seq, sk)?,
                        3 => ev.group_idx = lenient(&mut seq, sk)?,
                        _ => {
                            seq.next_element::<IgnoredAny>()?;
                            sk.unknown_fields += 1;
                        }
                    }
                }
                KvEvent::BlockRemoved(ev)
            }
            "AllBlocksCleared" => {
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    sk.unknown_fields += 1;
                }
                KvEvent::AllBlocksCleared
            }
            _ => {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                return self.not_an_event();
            }
        };
        // Elements past the ones we read (size_hint is exact for msgpack).
        while seq.next_element::<IgnoredAny>()?.is_some() {
            self.skipped.unknown_fields += 1;
        }
        Ok(Some(ev))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<KvEvent>, A::Error> {
        // Fields of either event kind, by name; the `type` key may come
        // anywhere, so the kind is decided at the end.
        let mut tag: Option<&'de str> = None;
        let mut stored = BlockStored::default();
        let mut medium = None;
        let mut group = None;
        let mut locality = None;
        let mut ownership = None;
        let (mut has_hashes, mut has_size) = (false, false);
        let mut bad: Option<&'static str> = None;
        // Keys read as fields: those only a BlockStored has, and those
        // BlockRemoved shares (counted as unknown for the other kinds).
        let (mut stored_only, mut shared) = (0u32, 0u32);
        let sk = &mut *self.skipped;
        while let Some(key) = map.next_key::<Lenient<&'de str>>()? {
            let Lenient::Ok(key) = key else {
                map.next_value::<IgnoredAny>()?;
                sk.unknown_fields += 1;
                continue;
            };
            match key {
                "block_hashes" | "medium" | "group_idx" | "locality" | "ownership" => shared += 1,
                "type" => {}
                _ => stored_only += 1,
            }
            match key {
                "type" if tag.is_some() => {
                    map.next_value::<IgnoredAny>()?;
                    sk.unknown_fields += 1;
                }
                "type" => {
                    tag = map.next_value::<Lenient<&'de str>>()?.ok();
                    if !matches!(
                        tag,
                        Some("BlockStored" | "BlockRemoved" | "AllBlocksCleared")
                    ) {
                        // Not an event we know: its fields are not ours to
                        // check (`type` comes first in practice).
                        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                        return self.not_an_event();
                    }
                }
                "block_hashes" => {
                    match map.next_value::<Hashes>()?.0.0 {
                        Some(h) => stored.block_hashes = h,
                        None => bad = Some("block_hashes"),
                    }
                    has_hashes = true;
                }
                "parent_block_hash" => match map.next_value::<OptHash>()?.0.0 {
                    Some(h) => stored.parent_block_hash = h,
                    None => bad = Some("parent_block_hash"),
                },
                "token_ids" => match map.next_value::<Tokens>()?.0.0 {
                    Some(t) => stored.token_ids = t,
                    None => bad = Some("token_ids"),
                },
                "block_size" => {
                    match map.next_value::<Size>()?.0.0 {
                        Some(b) => stored.block_size = b,
                        None => bad = Some("block_size"),
                    }
                    has_size = true;
                }
                "lora_id" => stored.lora_id = map_lenient(&mut map, sk)?,
                "medium" => medium = map_lenient_str(&mut map, sk)?,
                "lora_name" => stored.lora_name = map_lenient_str(&mut map, sk)?,
                "extra_keys" => stored.extra_keys = map.next_value::<ExtraKeys>()?.take(sk),
                "group_idx" => group = map_lenient(&mut map, sk)?,
                "kv_cache_spec_kind" => stored.kv_cache_spec_kind = map_lenient_str(&mut map, sk)?,
                "kv_cache_spec_sliding_window" => {
                    stored.kv_cache_spec_sliding_window = map_lenient(&mut map, sk)?;
                }
                "locality" => locality = map_lenient_str(&mut map, sk)?,
                "ownership" => ownership = map_lenient_str(&mut map, sk)?,
                "session_id" => stored.session_id = map_lenient_str(&mut map, sk)?,
                "lookahead_token_ids" => {
                    stored.lookahead_token_ids = map.next_value::<Lookahead>()?.take(sk);
                }
                "cache_salt" => stored.cache_salt = map_lenient_str(&mut map, sk)?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    sk.unknown_fields += 1;
                    stored_only -= 1;
                }
            }
        }
        match tag {
            Some("BlockRemoved") => sk.unknown_fields += stored_only,
            Some("AllBlocksCleared") => sk.unknown_fields += stored_only + shared,
            _ => {}
        }
        if let (Some(ev @ ("BlockStored" | "BlockRemoved")), Some(field)) = (tag, bad) {
            let event = if ev == "BlockStored" {
                "BlockStored"
            } else {
                "BlockRemoved"
            };
            let stored_only = !matches!(field, "block_hashes");
            if event == "BlockStored" || !stored_only {
                return Err(self.malformed(event, field));
            }
        }
        match tag {
            Some("BlockStored") => {
                if !has_hashes {
                    return Err(self.missing("BlockStored", "block_hashes"));
                }
                if !has_size {
                    return Err(self.missing("BlockStored", "block_size"));
                }
                stored.medium = medium;
                stored.group_idx = group;
                stored.locality = locality;
                stored.ownership = ownership;
                Ok(Some(KvEvent::BlockStored(stored)))
            }
            Some("BlockRemoved") => {
                if !has_hashes {
                    return Err(self.missing("BlockRemoved", "block_hashes"));
                }
                Ok(Some(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: stored.block_hashes,
                    medium,
                    group_idx: group,
                    locality,
                    ownership,
                })))
            }
            Some("AllBlocksCleared") => Ok(Some(KvEvent::AllBlocksCleared)),
            _ => self.not_an_event(),
        }
    }
}
