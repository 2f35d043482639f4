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

use kinference_kvindex::event::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, Skipped, Value,
};

/// vLLM's `extra_keys`: per block, nil or a list of values.
type PerBlockExtras = Vec<Option<Vec<Value>>>;

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

/// A value of the expected type, or the fact that it had another one.
enum Lenient<T> {
    Ok(T),
    Nil,
    Other,
}

impl<T> Lenient<T> {
    fn ok(self) -> Option<T> {
        match self {
            Lenient::Ok(v) => Some(v),
            _ => None,
        }
    }
}

/// Implements the visitor methods that make a value `Other`.
macro_rules! other {
    ($($f:ident: $t:ty),*) => {
        $(fn $f<E: de::Error>(self, _: $t) -> Result<Self::Value, E> {
            Ok(Lenient::Other)
        })*
    };
}
macro_rules! other_compound {
    () => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Lenient::Other)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Lenient::Other)
        }
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            IgnoredAny::deserialize(d)?;
            Ok(Lenient::Other)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Lenient::Nil)
        }
    };
}

/// Scalars where a list was expected: "another type".
macro_rules! other_value {
    () => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Self::Value::other())
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Self::Value::other())
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Self::Value::other())
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Self::Value::other())
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Self::Value::other())
        }
        fn visit_bytes<E>(self, _: &[u8]) -> Result<Self::Value, E> {
            Ok(Self::Value::other())
        }
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            IgnoredAny::deserialize(d)?;
            Ok(Self::Value::other())
        }
    };
}

impl<'de> de::Deserialize<'de> for Lenient<&'de str> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<&'de str>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Lenient::Ok(v))
            }
            other!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64,
                visit_str: &str, visit_bytes: &[u8]);
            other_compound!();
        }
        d.deserialize_any(V)
    }
}

/// Integer fields that must fit the target (u32 group, window, i64 id).
trait FromInt: Sized {
    fn from_u64(v: u64) -> Option<Self>;
    fn from_i64(v: i64) -> Option<Self>;
}
impl FromInt for u32 {
    fn from_u64(v: u64) -> Option<u32> {
        u32::try_from(v).ok()
    }
    fn from_i64(v: i64) -> Option<u32> {
        u32::try_from(v).ok()
    }
}
impl FromInt for i64 {
    fn from_u64(v: u64) -> Option<i64> {
        i64::try_from(v).ok()
    }
    fn from_i64(v: i64) -> Option<i64> {
        Some(v)
    }
}

struct LenientInt<T>(Lenient<T>);

impl<'de, T: FromInt> de::Deserialize<'de> for LenientInt<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: FromInt> Visitor<'de> for V<T> {
            type Value = Lenient<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(T::from_u64(v).map_or(Lenient::Nil, Lenient::Ok))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(T::from_i64(v).map_or(Lenient::Nil, Lenient::Ok))
            }
            other!(visit_bool: bool, visit_f64: f64, visit_str: &str, visit_bytes: &[u8]);
            other_compound!();
        }
        d.deserialize_any(V(std::marker::PhantomData))
            .map(LenientInt)
    }
}

fn count<T>(v: Lenient<T>, sk: &mut Skipped) -> Option<T> {
    match v {
        Lenient::Ok(v) => Some(v),
        Lenient::Nil => None,
        Lenient::Other => {
            sk.unknown_fields += 1;
            None
        }
    }
}

fn lenient<'de, T: FromInt, A: SeqAccess<'de>>(
    seq: &mut A,
    sk: &mut Skipped,
) -> Result<Option<T>, A::Error> {
    Ok(seq
        .next_element::<LenientInt<T>>()?
        .and_then(|v| count(v.0, sk)))
}

fn lenient_str<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    sk: &mut Skipped,
) -> Result<Option<String>, A::Error> {
    Ok(seq
        .next_element::<Lenient<&'de str>>()?
        .and_then(|v| count(v, sk))
        .map(str::to_owned))
}

fn map_lenient<'de, T: FromInt, A: MapAccess<'de>>(
    map: &mut A,
    sk: &mut Skipped,
) -> Result<Option<T>, A::Error> {
    Ok(count(map.next_value::<LenientInt<T>>()?.0, sk))
}

fn map_lenient_str<'de, A: MapAccess<'de>>(
    map: &mut A,
    sk: &mut Skipped,
) -> Result<Option<String>, A::Error> {
    Ok(count(map.next_value::<Lenient<&'de str>>()?, sk).map(str::to_owned))
}

fn extra_keys<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    sk: &mut Skipped,
) -> Result<Option<PerBlockExtras>, A::Error> {
    Ok(seq.next_element::<ExtraKeys>()?.and_then(|e| e.take(sk)))
}

/// A required field's value, or the fact that it was malformed (so the
/// event's kind decides whether that fails the batch).
struct Checked<T>(Option<T>);

impl<T> Checked<T> {
    fn bad() -> Self {
        Checked(None)
    }
}

/// The visitor methods of a [`Checked`] visitor for every type it does not
/// take: the value is skipped and marked malformed.
macro_rules! malformed {
    ($($f:ident: $t:ty),*) => {
        $(fn $f<E: de::Error>(self, _: $t) -> Result<Self::Value, E> {
            Ok(Checked::bad())
        })*
    };
}
macro_rules! malformed_compound {
    (seq) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Checked::bad())
        }
    };
    () => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Checked::bad())
        }
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            IgnoredAny::deserialize(d)?;
            Ok(Checked::bad())
        }
    };
}

/// A block hash: u64, i64 or bytes; `nil_ok`: nil is allowed (a parent).
fn hash_visitor<'de, const NIL_OK: bool>() -> impl Visitor<'de, Value = Checked<Option<BlockHash>>>
{
    struct V<const N: bool>;
    impl<'de, const N: bool> Visitor<'de> for V<N> {
        type Value = Checked<Option<BlockHash>>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a block hash (integer or bytes)")
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(if N {
                Checked(Some(None))
            } else {
                Checked::bad()
            })
        }
        fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Checked(Some(Some(BlockHash::Uint(v)))))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Checked(Some(Some(BlockHash::Int(v)))))
        }
        fn visit_bytes<E>(self, v: &[u8]) -> Result<Self::Value, E> {
            Ok(Checked(Some(Some(BlockHash::Bytes(v.to_vec())))))
        }
        fn visit_borrowed_bytes<E>(self, v: &'de [u8]) -> Result<Self::Value, E> {
            Ok(Checked(Some(Some(BlockHash::Bytes(v.to_vec())))))
        }
        malformed!(visit_bool: bool, visit_f64: f64, visit_str: &str);
        malformed_compound!(seq);
        malformed_compound!();
    }
    V::<NIL_OK>
}

/// A block hash (in a list).
struct Hash(Checked<Option<BlockHash>>);

impl<'de> de::Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Hash, D::Error> {
        d.deserialize_any(hash_visitor::<false>()).map(Hash)
    }
}

/// `parent_block_hash`: a hash or nil.
struct OptHash(Checked<Option<BlockHash>>);

impl<'de> de::Deserialize<'de> for OptHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<OptHash, D::Error> {
        d.deserialize_any(hash_visitor::<true>()).map(OptHash)
    }
}

/// `block_hashes`: a list of hashes; nil is empty.
struct Hashes(Checked<Vec<BlockHash>>);

impl<'de> de::Deserialize<'de> for Hashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Hashes, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Checked<Vec<BlockHash>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of block hashes")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Checked(Some(Vec::new())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(65_536));
                let mut ok = true;
                while let Some(h) = seq.next_element::<Hash>()? {
                    match h.0.0 {
                        Some(Some(h)) => v.push(h),
                        _ => ok = false,
                    }
                }
                Ok(Checked(ok.then_some(v)))
            }
            malformed!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64,
                visit_str: &str, visit_bytes: &[u8]);
            malformed_compound!();
        }
        d.deserialize_any(V).map(Hashes)
    }
}

/// `token_ids`: a list of u32; nil is empty.
struct Tokens(Checked<Vec<u32>>);

impl<'de> de::Deserialize<'de> for Tokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Tokens, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Checked<Vec<u32>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of token ids")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Checked(Some(Vec::new())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                let mut ok = true;
                while let Some(t) = seq.next_element::<Token>()? {
                    match t.0 {
                        Some(t) => v.push(t),
                        None => ok = false,
                    }
                }
                Ok(Checked(ok.then_some(v)))
            }
            malformed!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64,
                visit_str: &str, visit_bytes: &[u8]);
            malformed_compound!();
        }
        d.deserialize_any(V).map(Tokens)
    }
}

/// One token id: a u32, else malformed.
struct Token(Option<u32>);

impl<'de> de::Deserialize<'de> for Token {
    #[inline]
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Token, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Token;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id")
            }
            #[inline]
            fn visit_u8<E>(self, v: u8) -> Result<Token, E> {
                Ok(Token(Some(u32::from(v))))
            }
            #[inline]
            fn visit_u16<E>(self, v: u16) -> Result<Token, E> {
                Ok(Token(Some(u32::from(v))))
            }
            #[inline]
            fn visit_u32<E>(self, v: u32) -> Result<Token, E> {
                Ok(Token(Some(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Token, E> {
                Ok(Token(u32::try_from(v).ok()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Token, E> {
                Ok(Token(u32::try_from(v).ok()))
            }
            fn visit_unit<E>(self) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_bytes<E>(self, _: &[u8]) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Token, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Token(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Token, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Token(None))
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Token, D::Error> {
                IgnoredAny::deserialize(d)?;
                Ok(Token(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// `block_size`: u32; nil is 0.
struct Size(Checked<u32>);

impl<'de> de::Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Checked<u32>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block size")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Checked(Some(0)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Checked(u32::try_from(v).ok()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Checked(u32::try_from(v).ok()))
            }
            malformed!(visit_bool: bool, visit_f64: f64, visit_str: &str, visit_bytes: &[u8]);
            malformed_compound!(seq);
            malformed_compound!();
        }
        d.deserialize_any(V).map(Size)
    }
}

/// Positional element 7 of a `BlockStored`: vLLM's `lora_name`, or SGLang
/// 0.5.18's metadata map `{"cache_salt": …}` (with how many other keys).
enum Field7<'a> {
    Str(&'a str),
    Salt(Option<&'a str>, u32),
    Nil,
    Other,
}

impl<'de> de::Deserialize<'de> for Field7<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Field7<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a LoRA name or a metadata map")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Field7::Str(v))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Field7::Nil)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let (mut salt, mut other) = (None, 0);
                while let Some(k) = map.next_key::<Lenient<&'de str>>()? {
                    if let Lenient::Ok("cache_salt") = k {
                        match map.next_value::<Lenient<&'de str>>()? {
                            Lenient::Ok(s) => salt = Some(s),
                            Lenient::Nil => {}
                            Lenient::Other => other += 1,
                        }
                    } else {
                        map.next_value::<IgnoredAny>()?;
                        other += 1;
                    }
                }
                Ok(Field7::Salt(salt, other))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Field7::Other)
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                IgnoredAny::deserialize(d)?;
                Ok(Field7::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Field7::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Field7::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Field7::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Field7::Other)
            }
            fn visit_bytes<E>(self, _: &[u8]) -> Result<Self::Value, E> {
                Ok(Field7::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// `extra_keys`: nil, or a list with one entry per block (nil or a list
/// of values); entries of other types are counted and read as nil.
struct ExtraKeys(Lenient<PerBlockExtras>, u32);

impl ExtraKeys {
    fn take(self, sk: &mut Skipped) -> Option<PerBlockExtras> {
        sk.unknown_fields += self.1;
        count(self.0, sk)
    }
}

impl<'de> de::Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of extra keys per block")
            }
            fn visit_unit<E>(self) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Lenient::Nil, 0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKeys, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(65_536));
                let mut bad = 0;
                while let Some(Val(v)) = seq.next_element::<Val>()? {
                    match v {
                        Value::Nil => out.push(None),
                        Value::Array(items) => out.push(Some(items)),
                        _ => {
                            bad += 1;
                            out.push(None);
                        }
                    }
                }
                Ok(ExtraKeys(Lenient::Ok(out), bad))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ExtraKeys, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ExtraKeys(Lenient::Other, 0))
            }
            other_value!();
        }
        d.deserialize_any(V)
    }
}

/// `lookahead_token_ids`: nil, or a list of token lists.
struct Lookahead(Lenient<Vec<Vec<u32>>>);

impl Lookahead {
    fn take(self, sk: &mut Skipped) -> Option<Vec<Vec<u32>>> {
        count(self.0, sk)
    }
}

impl<'de> de::Deserialize<'de> for Lookahead {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lookahead;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of token lists")
            }
            fn visit_unit<E>(self) -> Result<Lookahead, E> {
                Ok(Lookahead(Lenient::Nil))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Lookahead, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(65_536));
                let mut ok = true;
                while let Some(t) = seq.next_element::<Tokens>()? {
                    match t.0.0 {
                        Some(t) => out.push(t),
                        None => ok = false,
                    }
                }
                Ok(Lookahead(if ok {
                    Lenient::Ok(out)
                } else {
                    Lenient::Other
                }))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Lookahead, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Lookahead(Lenient::Other))
            }
            other_value!();
        }
        d.deserialize_any(V)
    }
}

impl ExtraKeys {
    fn other() -> Self {
        ExtraKeys(Lenient::Other, 0)
    }
}
impl Lookahead {
    fn other() -> Self {
        Lookahead(Lenient::Other)
    }
}

/// A generic value (extra keys): every msgpack type; ext values read as
/// nil.
struct Val(Value);

impl<'de> de::Deserialize<'de> for Val {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Val, D::Error> {
        d.deserialize_any(ValueVisitor).map(Val)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a msgpack value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Nil)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Uint(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }
    fn visit_bytes<E>(self, v: &[u8]) -> Result<Value, E> {
        Ok(Value::Bin(v.to_vec()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(x) = seq.next_element::<Val>()? {
            v.push(x.0);
        }
        Ok(Value::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut v = Vec::with_capacity(map.size_hint().unwrap_or(0).min(4096));
        while let Some((k, x)) = map.next_entry::<Val, Val>()? {
            v.push((k.0, x.0));
        }
        Ok(Value::Map(v))
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        IgnoredAny::deserialize(d)?;
        Ok(Value::Nil)
    }
}
