//! The field types of the reference decoder: hashes, token ids, sizes,
//! lenient optional scalars, extra keys, generic values.

use std::fmt;

use kinference_kvindex::event::{BlockHash, Skipped, Value};
use serde::de::{self, Deserialize as _, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// vLLM's `extra_keys`: per block, nil or a list of values.
pub(super) type PerBlockExtras = Vec<Option<Vec<Value>>>;

/// A value of the expected type, or the fact that it had another one.
pub(super) enum Lenient<T> {
    Ok(T),
    Nil,
    Other,
}

impl<T> Lenient<T> {
    pub(super) fn ok(self) -> Option<T> {
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
pub(super) trait FromInt: Sized {
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

pub(super) struct LenientInt<T>(pub(super) Lenient<T>);

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

pub(super) fn count<T>(v: Lenient<T>, sk: &mut Skipped) -> Option<T> {
    match v {
        Lenient::Ok(v) => Some(v),
        Lenient::Nil => None,
        Lenient::Other => {
            sk.unknown_fields += 1;
            None
        }
    }
}

pub(super) fn lenient<'de, T: FromInt, A: SeqAccess<'de>>(
    seq: &mut A,
    sk: &mut Skipped,
) -> Result<Option<T>, A::Error> {
    Ok(seq
        .next_element::<LenientInt<T>>()?
        .and_then(|v| count(v.0, sk)))
}

pub(super) fn lenient_str<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    sk: &mut Skipped,
) -> Result<Option<String>, A::Error> {
    Ok(seq
        .next_element::<Lenient<&'de str>>()?
        .and_then(|v| count(v, sk))
        .map(str::to_owned))
}

pub(super) fn map_lenient<'de, T: FromInt, A: MapAccess<'de>>(
    map: &mut A,
    sk: &mut Skipped,
) -> Result<Option<T>, A::Error> {
    Ok(count(map.next_value::<LenientInt<T>>()?.0, sk))
}

pub(super) fn map_lenient_str<'de, A: MapAccess<'de>>(
    map: &mut A,
    sk: &mut Skipped,
) -> Result<Option<String>, A::Error> {
    Ok(count(map.next_value::<Lenient<&'de str>>()?, sk).map(str::to_owned))
}

pub(super) fn extra_keys<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    sk: &mut Skipped,
) -> Result<Option<PerBlockExtras>, A::Error> {
    Ok(seq.next_element::<ExtraKeys>()?.and_then(|e| e.take(sk)))
}

/// A required field's value, or the fact that it was malformed (so the
/// event's kind decides whether that fails the batch).
pub(super) struct Checked<T>(pub(super) Option<T>);

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
pub(super) fn hash_visitor<'de, const NIL_OK: bool>()
-> impl Visitor<'de, Value = Checked<Option<BlockHash>>> {
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
pub(super) struct Hash(pub(super) Checked<Option<BlockHash>>);

impl<'de> de::Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Hash, D::Error> {
        d.deserialize_any(hash_visitor::<false>()).map(Hash)
    }
}

/// `parent_block_hash`: a hash or nil.
pub(super) struct OptHash(pub(super) Checked<Option<BlockHash>>);

impl<'de> de::Deserialize<'de> for OptHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<OptHash, D::Error> {
        d.deserialize_any(hash_visitor::<true>()).map(OptHash)
    }
}

/// `block_hashes`: a list of hashes; nil is empty.
pub(super) struct Hashes(pub(super) Checked<Vec<BlockHash>>);

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
pub(super) struct Tokens(pub(super) Checked<Vec<u32>>);

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
pub(super) struct Token(pub(super) Option<u32>);

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
pub(super) struct Size(pub(super) Checked<u32>);

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
pub(super) enum Field7<'a> {
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
pub(super) struct ExtraKeys(Lenient<PerBlockExtras>, u32);

impl ExtraKeys {
    pub(super) fn take(self, sk: &mut Skipped) -> Option<PerBlockExtras> {
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
pub(super) struct Lookahead(Lenient<Vec<Vec<u32>>>);

impl Lookahead {
    pub(super) fn take(self, sk: &mut Skipped) -> Option<Vec<Vec<u32>>> {
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
pub(super) struct Val(pub(super) Value);

impl<'de> de::Deserialize<'de> for Val {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Val, D::Error> {
        d.deserialize_any(ValueVisitor).map(Val)
    }
}

pub(super) struct ValueVisitor;

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
