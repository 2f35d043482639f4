//! MessagePack: a small, allocation-free reader, and a writer on `rmp`'s
//! encoders that produces the same bytes as Python `msgspec`.
//!
//! The reader is hand-written because decoding is the router's hot path:
//! serde over `rmp-serde` decodes vLLM's 32-block payloads at about a third
//! of its speed (`benches/README.md`, "Decoding"), below the index's
//! decode+apply goal. It never panics: every read is bounds-checked and
//! returns [`MsgError`] on truncated or malformed input. Nesting is
//! limited to [`MAX_DEPTH`] so hostile input cannot exhaust the stack.

use rmp::Marker;
use rmp::encode::{self, ByteBuf, RmpWrite as _};

use crate::event::Value;

/// Deepest nesting of arrays/maps the reader follows when skipping or
/// reading a generic [`Value`].
pub const MAX_DEPTH: usize = 32;

/// What went wrong while reading MessagePack.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    /// The input ended inside a value.
    #[error("truncated msgpack at byte {0}")]
    Truncated(usize),
    /// A value had another type than the schema allows.
    #[error("expected {expected} at byte {at}, found marker 0x{marker:02x}")]
    Type {
        /// What the decoder wanted.
        expected: &'static str,
        /// Offset of the marker.
        at: usize,
        /// The marker byte found.
        marker: u8,
    },
    /// The marker 0xc1 (never used) or nesting deeper than 32 levels.
    #[error("invalid msgpack at byte {0}")]
    Invalid(usize),
    /// A string was not UTF-8.
    #[error("string at byte {0} is not utf-8")]
    Utf8(usize),
    /// An integer did not fit the target type.
    #[error("integer at byte {0} is out of range")]
    Range(usize),
}

/// The kind of the next value, as far as the decoder cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

/// Per marker byte: (length, mask) of the unsigned integers that fit u32:
/// the value is the `length` bytes from the marker on, read big-endian,
/// masked (a fixint is its marker). Length 0: another encoding.
const U32_CLASS: [(u8, u32); 256] = {
    let mut t = [(0u8, 0u32); 256];
    let mut m = 0;
    while m < 0x80 {
        t[m] = (1, 0x7f);
        m += 1;
    }
    t[0xcc] = (2, 0xff);
    t[0xcd] = (3, 0xffff);
    t[0xce] = (5, 0xffff_ffff);
    t
};

/// 1 for the markers [`Reader::read_u32s`]'s segmented path takes
/// (fixint, uint8, uint16, uint32), 0 for the rest.
const MARKER_OK: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut m = 0;
    while m < 256 {
        t[m] = (U32_CLASS[m].0 != 0) as u8;
        m += 1;
    }
    t
};

/// A cursor over a MessagePack byte slice.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// An integer as read: msgpack distinguishes unsigned and signed encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    U(u64),
    I(i64),
}

impl Int {
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Int::U(v) => Some(v),
            Int::I(v) => u64::try_from(v).ok(),
        }
    }
    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Int::U(v) => i64::try_from(v).ok(),
            Int::I(v) => Some(v),
        }
    }
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn byte(&mut self) -> Result<u8, MsgError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(MsgError::Truncated(self.pos))?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(MsgError::Truncated(self.pos))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or(MsgError::Truncated(self.pos))?;
        self.pos = end;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn peek(&self) -> Result<u8, MsgError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(MsgError::Truncated(self.pos))
    }

    /// The kind of the next value without consuming it.
    pub(crate) fn peek_kind(&self) -> Result<Kind, MsgError> {
        let m = self.peek()?;
        Ok(match m {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xca | 0xcb => Kind::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            _ => return Err(MsgError::Invalid(self.pos)),
        })
    }

    fn type_err(&self, expected: &'static str) -> MsgError {
        match self.peek() {
            Ok(marker) => MsgError::Type {
                expected,
                at: self.pos,
                marker,
            },
            Err(e) => e,
        }
    }

    /// Consumes a nil if one is next; returns whether it did.
    pub(crate) fn try_nil(&mut self) -> Result<bool, MsgError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// A uint64 written with the 0xcf marker, if that is next.
    #[inline]
    pub(crate) fn try_u64_marker(&mut self) -> Option<u64> {
        let b = self.buf.get(self.pos..self.pos.checked_add(9)?)?;
        if b[0] != 0xcf {
            return None;
        }
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[1..]);
        self.pos += 9;
        Some(u64::from_be_bytes(a))
    }

    /// Up to `n` uint64s written with the 0xcf marker, while that is
    /// the next marker, each given to `f`; returns how many were read.
    #[inline]
    pub(crate) fn read_u64_run(&mut self, n: usize, mut f: impl FnMut(u64)) -> usize {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let mut taken = 0;
        for chunk in rest.chunks_exact(9).take(n) {
            let Some((&0xcf, v)) = chunk.split_first() else {
                break;
            };
            let mut a = [0u8; 8];
            a.copy_from_slice(v);
            f(u64::from_be_bytes(a));
            taken += 1;
        }
        self.pos += taken * 9;
        taken
    }

    /// Consumes `n` nils if the next `n` values are all nil; returns
    /// whether it did (nothing is consumed otherwise).
    pub(crate) fn skip_nil_run(&mut self, n: usize) -> bool {
        const NILS: u64 = 0xc0c0_c0c0_c0c0_c0c0;
        let Some(run) = self
            .pos
            .checked_add(n)
            .and_then(|end| self.buf.get(self.pos..end))
        else {
            return false;
        };
        let mut words = run.chunks_exact(8);
        let all = words
            .by_ref()
            .all(|w| u64::from_ne_bytes(w.try_into().unwrap_or_default()) == NILS)
            && words.remainder().iter().all(|&b| b == 0xc0);
        if all {
            self.pos += n;
        }
        all
    }

    pub(crate) fn read_int(&mut self) -> Result<Int, MsgError> {
        let at = self.pos;
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Int::U(u64::from(m)),
            0xe0..=0xff => Int::I(i64::from(m as i8)),
            0xcc => Int::U(u64::from(self.byte()?)),
            0xcd => Int::U(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Int::U(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Int::U(u64::from_be_bytes(self.be()?)),
            0xd0 => Int::I(i64::from(self.byte()? as i8)),
            0xd1 => Int::I(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Int::I(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Int::I(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = at;
                return Err(self.type_err("integer"));
            }
        })
    }

    /// `n` unsigned integers that fit u32 (token ids), appended to `out`.
    /// The common encodings (fixint, uint8/16/32) take a fast path.
    pub(crate) fn read_u32s(&mut self, n: usize, out: &mut Vec<u32>) -> Result<(), MsgError> {
        let start = out.len();
        out.resize(start + n, 0);
        let at = self.pos;
        let done = self.read_u32s_segmented(&mut out[start..]);
        if done.is_none() {
            // A marker the fast paths do not take: read them all again
            // with the checked reader, which reports where it is.
            self.pos = at;
            self.read_u32s_checked(&mut out[start..])?;
        }
        Ok(())
    }

    /// The fast path of [`read_u32s`](Self::read_u32s): token ids are
    /// fixint, uint8, uint16 or uint32 (1, 2, 3 or 5 bytes), so where the
    /// next one starts depends on the marker of this one. Following that
    /// chain marker by marker (load, look up, add) is what bounds the
    /// speed, so the length every byte would have as a marker is worked
    /// out first for a segment of bytes, eight at a time and independently
    /// of each other; the chain is then one byte load and one add per id,
    /// and each value is read beside it. Ids left near the end of the
    /// buffer are read one by one. Returns `None`, having consumed nothing
    /// that matters, at the first marker of another encoding.
    fn read_u32s_segmented(&mut self, out: &mut [u32]) -> Option<()> {
        const SEG: usize = 512;
        const ONES: u64 = 0x0101_0101_0101_0101;
        let buf = self.buf;
        let mut lens = [0u8; SEG];
        let mut pos = self.pos;
        let mut i = 0;
        let mut invalid = 0u8;
        while i < out.len() {
            // Room for the segment and an 8-byte read at its last marker;
            // no more than the ids left can take (5 bytes each).
            let room = buf.len().saturating_sub(pos + 8);
            let seg_len = room.min(SEG).min((out.len() - i) * 5 + 7) & !7;
            if seg_len < 8 {
                break;
            }
            let seg = &buf[pos..pos + seg_len + 8];
            for (src, dst) in seg[..seg_len].chunks_exact(8).zip(lens.chunks_exact_mut(8)) {
                // Per byte b: 1 below 0x80 (fixint), else by b & 3:
                // 0xcc → 2, 0xcd → 3, 0xce → 5 (other markers get some
                // length and are caught by `MARKER_OK` below).
                let x = u64::from_le_bytes(src.try_into().ok()?);
                let high = ((x >> 7) & ONES) * 0xff;
                let low = x & (ONES * 3);
                let wide = low + ONES * 2 + ((low >> 1) & !low & ONES);
                let len = (wide & high) | (ONES & !high);
                dst.copy_from_slice(&len.to_le_bytes());
            }
            let mut p = 0;
            while p < seg_len && i < out.len() {
                let len = usize::from(lens[p]);
                let w = u64::from_be_bytes(seg[p..p + 8].try_into().ok()?);
                let bits = (len * 8) as u32;
                let mask = ((1u64 << (bits - 8)) - 1) | 0xff;
                out[i] = ((w >> (64 - bits)) & mask) as u32;
                invalid |= MARKER_OK[(w >> 56) as usize] ^ 1;
                p += len;
                i += 1;
            }
            pos += p;
        }
        if invalid != 0 {
            return None;
        }
        while i < out.len() {
            let w = u64::from_be_bytes(buf.get(pos..pos + 8)?.try_into().ok()?);
            let (len, mask) = U32_CLASS[(w >> 56) as usize];
            if len == 0 {
                return None;
            }
            out[i] = (w >> (64 - 8 * u32::from(len))) as u32 & mask;
            pos += usize::from(len);
            i += 1;
        }
        self.pos = pos;
        Some(())
    }

    /// `out.len()` unsigned integers that fit u32, each read and checked
    /// by [`read_u32`](Self::read_u32), the common encodings first through
    /// the marker table.
    fn read_u32s_checked(&mut self, out: &mut [u32]) -> Result<(), MsgError> {
        let buf = self.buf;
        let mut pos = self.pos;
        let mut i = 0;
        while i < out.len() {
            let Some(chunk) = buf.get(pos..pos + 8) else {
                break;
            };
            let w = u64::from_be_bytes(chunk.try_into().expect("8 bytes"));
            let (len, mask) = U32_CLASS[(w >> 56) as usize];
            if len == 0 {
                break;
            }
            out[i] = (w >> (64 - 8 * u32::from(len))) as u32 & mask;
            pos += usize::from(len);
            i += 1;
        }
        // Other encodings, and the last bytes of the buffer.
        while i < out.len() {
            self.pos = pos;
            out[i] = self.read_u32()?;
            pos = self.pos;
            i += 1;
        }
        self.pos = pos;
        Ok(())
    }

    pub(crate) fn read_u32(&mut self) -> Result<u32, MsgError> {
        let at = self.pos;
        let v = self.read_int()?.as_u64().ok_or(MsgError::Range(at))?;
        u32::try_from(v).map_err(|_| MsgError::Range(at))
    }

    /// A float64/float32, or an integer read as a float (`ts` may be an int).
    pub(crate) fn read_f64(&mut self) -> Result<f64, MsgError> {
        match self.peek()? {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            _ => match self.read_int()? {
                Int::U(v) => Ok(v as f64),
                Int::I(v) => Ok(v as f64),
            },
        }
    }

    pub(crate) fn read_bool(&mut self) -> Result<bool, MsgError> {
        match self.peek()? {
            0xc2 => {
                self.pos += 1;
                Ok(false)
            }
            0xc3 => {
                self.pos += 1;
                Ok(true)
            }
            _ => Err(self.type_err("bool")),
        }
    }

    pub(crate) fn read_str(&mut self) -> Result<&'a str, MsgError> {
        let at = self.pos;
        let m = self.byte()?;
        let len = match m {
            0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => usize::from(self.byte()?),
            0xda => usize::from(u16::from_be_bytes(self.be()?)),
            0xdb => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.type_err("string"));
            }
        };
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|_| MsgError::Utf8(at))
    }

    /// A string's bytes, not checked for UTF-8 (map keys are compared as
    /// bytes).
    pub(crate) fn read_str_bytes(&mut self) -> Result<&'a [u8], MsgError> {
        let at = self.pos;
        let m = self.byte()?;
        let len = match m {
            0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => usize::from(self.byte()?),
            0xda => usize::from(u16::from_be_bytes(self.be()?)),
            0xdb => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.type_err("string"));
            }
        };
        self.take(len)
    }

    pub(crate) fn read_bin(&mut self) -> Result<&'a [u8], MsgError> {
        let at = self.pos;
        let m = self.byte()?;
        let len = match m {
            0xc4 => usize::from(self.byte()?),
            0xc5 => usize::from(u16::from_be_bytes(self.be()?)),
            0xc6 => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.type_err("bin"));
            }
        };
        self.take(len)
    }

    /// An array header; the element count is checked against the bytes left
    /// (every element takes at least one byte), so a hostile length cannot
    /// make a caller pre-allocate gigabytes.
    pub(crate) fn read_array_len(&mut self) -> Result<usize, MsgError> {
        let at = self.pos;
        let m = self.byte()?;
        let len = match m {
            0x90..=0x9f => usize::from(m & 0x0f),
            0xdc => usize::from(u16::from_be_bytes(self.be()?)),
            0xdd => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.type_err("array"));
            }
        };
        if len > self.buf.len() - self.pos {
            return Err(MsgError::Truncated(self.pos));
        }
        Ok(len)
    }

    pub(crate) fn read_map_len(&mut self) -> Result<usize, MsgError> {
        let at = self.pos;
        let m = self.byte()?;
        let len = match m {
            0x80..=0x8f => usize::from(m & 0x0f),
            0xde => usize::from(u16::from_be_bytes(self.be()?)),
            0xdf => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.type_err("map"));
            }
        };
        if len.saturating_mul(2) > self.buf.len() - self.pos {
            return Err(MsgError::Truncated(self.pos));
        }
        Ok(len)
    }

    /// Skips one value of any type.
    pub(crate) fn skip(&mut self) -> Result<(), MsgError> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: usize) -> Result<(), MsgError> {
        if depth > MAX_DEPTH {
            return Err(MsgError::Invalid(self.pos));
        }
        match self.peek_kind()? {
            Kind::Nil | Kind::Bool => {
                self.pos += 1;
            }
            Kind::Int => {
                self.read_int()?;
            }
            Kind::Float => {
                self.read_f64()?;
            }
            Kind::Str => {
                let at = self.pos;
                // Skip without UTF-8 validation.
                let m = self.byte()?;
                let len = match m {
                    0xa0..=0xbf => usize::from(m & 0x1f),
                    0xd9 => usize::from(self.byte()?),
                    0xda => usize::from(u16::from_be_bytes(self.be()?)),
                    0xdb => u32::from_be_bytes(self.be()?) as usize,
                    _ => return Err(MsgError::Invalid(at)),
                };
                self.take(len)?;
            }
            Kind::Bin => {
                self.read_bin()?;
            }
            Kind::Array => {
                let n = self.read_array_len()?;
                for _ in 0..n {
                    self.skip_depth(depth + 1)?;
                }
            }
            Kind::Map => {
                let n = self.read_map_len()?;
                for _ in 0..n * 2 {
                    self.skip_depth(depth + 1)?;
                }
            }
            Kind::Ext => {
                let m = self.byte()?;
                let len = match m {
                    0xd4 => 2,
                    0xd5 => 3,
                    0xd6 => 5,
                    0xd7 => 9,
                    0xd8 => 17,
                    0xc7 => usize::from(self.byte()?) + 1,
                    0xc8 => usize::from(u16::from_be_bytes(self.be()?)) + 1,
                    _ => u32::from_be_bytes(self.be()?) as usize + 1,
                };
                self.take(len)?;
            }
        }
        Ok(())
    }

    /// Reads any value into a generic [`Value`] tree.
    pub(crate) fn read_value(&mut self) -> Result<Value, MsgError> {
        self.read_value_depth(0)
    }

    fn read_value_depth(&mut self, depth: usize) -> Result<Value, MsgError> {
        if depth > MAX_DEPTH {
            return Err(MsgError::Invalid(self.pos));
        }
        Ok(match self.peek_kind()? {
            Kind::Nil => {
                self.pos += 1;
                Value::Nil
            }
            Kind::Bool => Value::Bool(self.read_bool()?),
            Kind::Int => match self.read_int()? {
                Int::U(v) => Value::Uint(v),
                Int::I(v) => Value::Int(v),
            },
            Kind::Float => Value::Float(self.read_f64()?),
            Kind::Str => Value::Str(self.read_str()?.to_owned()),
            Kind::Bin => Value::Bin(self.read_bin()?.to_vec()),
            Kind::Array => {
                let n = self.read_array_len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.read_value_depth(depth + 1)?);
                }
                Value::Array(v)
            }
            Kind::Map => {
                let n = self.read_map_len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let k = self.read_value_depth(depth + 1)?;
                    let val = self.read_value_depth(depth + 1)?;
                    v.push((k, val));
                }
                Value::Map(v)
            }
            Kind::Ext => {
                self.skip()?;
                Value::Nil
            }
        })
    }
}

/// Writes MessagePack the way msgspec encodes (minimal-width integers and
/// headers, float64 for floats), on `rmp`'s encoders.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    buf: ByteBuf,
}

impl Writer {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Writer {
            buf: ByteBuf::with_capacity(n),
        }
    }

    pub(crate) fn into_vec(self) -> Vec<u8> {
        self.buf.into_vec()
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        self.buf.as_slice()
    }

    pub(crate) fn nil(&mut self) {
        let Ok(()) = encode::write_nil(&mut self.buf);
    }

    pub(crate) fn bool(&mut self, v: bool) {
        let Ok(()) = encode::write_bool(&mut self.buf, v);
    }

    pub(crate) fn uint(&mut self, v: u64) {
        let Ok(_) = encode::write_uint(&mut self.buf, v);
    }

    pub(crate) fn int(&mut self, v: i64) {
        let Ok(_) = encode::write_sint(&mut self.buf, v);
    }

    pub(crate) fn f64(&mut self, v: f64) {
        let Ok(()) = encode::write_f64(&mut self.buf, v);
    }

    pub(crate) fn str(&mut self, s: &str) {
        let Ok(()) = encode::write_str(&mut self.buf, s);
    }

    pub(crate) fn bin(&mut self, b: &[u8]) {
        let Ok(()) = encode::write_bin(&mut self.buf, b);
    }

    pub(crate) fn array(&mut self, n: usize) {
        let Ok(_) = encode::write_array_len(&mut self.buf, n as u32);
    }

    pub(crate) fn map(&mut self, n: usize) {
        let Ok(_) = encode::write_map_len(&mut self.buf, n as u32);
    }

    /// A map header always in the 3-byte form, as msgspec writes structs
    /// with more than 15 fields even when fewer are present.
    pub(crate) fn map16(&mut self, n: usize) {
        let n = n.min(usize::from(u16::MAX)) as u16;
        let [hi, lo] = n.to_be_bytes();
        let Ok(()) = self.buf.write_bytes(&[Marker::Map16.to_u8(), hi, lo]);
    }

    pub(crate) fn value(&mut self, v: &Value) {
        match v {
            Value::Nil => self.nil(),
            Value::Bool(b) => self.bool(*b),
            Value::Uint(u) => self.uint(*u),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => self.f64(*f),
            Value::Str(s) => self.str(s),
            Value::Bin(b) => self.bin(b),
            Value::Array(a) => {
                self.array(a.len());
                for x in a {
                    self.value(x);
                }
            }
            Value::Map(m) => {
                self.map(m.len());
                for (k, x) in m {
                    self.value(k);
                    self.value(x);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
