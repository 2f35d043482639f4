//! Byte-level BPE merges with the ids `tokenizers` gives, without its
//! per-piece allocations.
//!
//! `tokenizers`' `BPE::tokenize` looks every character up as a `String` in
//! the vocabulary, runs the merges, then builds a `Token` (with the token's
//! text copied out of the vocabulary and its offsets) for every id, and
//! consults a word cache behind a thread-local map keyed by the piece's
//! `String`. On text it has not seen (a new conversation), that is most of
//! the cost of encoding. This module runs the same algorithm on the piece's
//! bytes: the byte-level alphabet makes every byte one symbol, looked up in
//! a 256-entry table; a piece that spells a token (most pieces of real
//! text: words with their leading space) is one probe of a table of the
//! vocabulary's spellings, and is that token when the merges, run once
//! the first time any request has that piece and remembered per token, end
//! in it; other pieces run the merges, one hash probe per candidate pair,
//! with the heap and symbol list reused across pieces.
//!
//! # The same ids
//!
//! The merge loop follows `tokenizers`' `Word::merge_all`: a min-heap of
//! candidate merges ordered by rank, then by position; a popped candidate
//! whose left symbol was absorbed, or whose pair no longer yields the same
//! merged id, is stale and skipped; a merge pushes the pairs it forms with
//! its neighbours. The merge table is built as `tokenizers` builds it (the
//! index in `merges` is the rank, a later duplicate replaces an earlier
//! one, the merged id is the vocabulary's id of the concatenation), and
//! `ignore_merges` returns a piece that is itself in the vocabulary as that
//! one id. Models with dropout, an unknown-token or byte fallback, a
//! subword prefix or suffix, or a byte missing from the vocabulary are not
//! handled (`from_model_json` gives `None`) and keep `tokenizers`' route.
//! The `fast_path` tests compare both routes on random text for the three
//! real tokenizers in `testdata/`.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU8, Ordering};

use hashbrown::HashMap;
use serde::Deserialize;

/// The vocabulary as read: strings borrowed from the file where they
/// have no escapes.
type Vocab<'a> = std::collections::HashMap<Cow<'a, str>, u32, hashbrown::DefaultHashBuilder>;

/// The BPE model section of `tokenizer.json`, as far as this module reads it.
#[derive(Deserialize)]
pub(crate) struct ModelJson<'a> {
    #[serde(default, borrow)]
    vocab: Vocab<'a>,
    #[serde(default, borrow)]
    merges: Vec<MergeJson<'a>>,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    unk_token: Option<String>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
}

/// One merge: `"a b"` (the older format) or `["a", "b"]`.
enum MergeJson<'a> {
    Line(Cow<'a, str>),
    Pair(Cow<'a, str>, Cow<'a, str>),
}

impl<'de: 'a, 'a> Deserialize<'de> for MergeJson<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = MergeJson<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#"a merge, "a b" or ["a", "b"]"#)
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(MergeJson::Line(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MergeJson::Line(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut next = || -> Result<Cow<'a, str>, A::Error> {
                    seq.next_element::<Str<'a>>()?
                        .map(|s| s.0)
                        .ok_or_else(|| serde::de::Error::invalid_length(0, &"two tokens"))
                };
                let (a, b) = (next()?, next()?);
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(3, &"two tokens"));
                }
                Ok(MergeJson::Pair(a, b))
            }
        }
        d.deserialize_any(Visit(std::marker::PhantomData))
    }
}

/// A string borrowed from the file where it has no escapes.
#[derive(Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

/// Merges over a byte-level vocabulary.
pub(crate) struct Bpe {
    /// Byte → id of the token spelling that byte's character.
    byte_ids: [u32; 256],
    /// `(left << 32) | right` → (rank, merged id).
    merges: HashMap<u64, (u32, u32)>,
    /// The same for the pairs of two bytes' tokens, by `left byte << 8 |
    /// right byte` (`(u32::MAX, NONE)`: no merge): a piece's first pass
    /// looks up only these.
    byte_pairs: Box<[(u32, u32)]>,
    /// The bytes of every token of two or more bytes → its id.
    spellings: HashMap<Box<[u8]>, u32>,
    /// By token id: whether a piece spelling that token is that one token
    /// (`WHOLE`, `SPLIT`, or `UNKNOWN` until first seen; see
    /// [`Bpe::is_whole`]). Written without a lock: every writer stores the
    /// same verdict.
    verdicts: Box<[AtomicU8]>,
}

impl std::fmt::Debug for Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bpe")
            .field("merges", &self.merges.len())
            .field("spellings", &self.spellings.len())
            .finish_non_exhaustive()
    }
}

/// Buffers one encoding reuses across its pieces.
#[derive(Default)]
pub(crate) struct Scratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>,
    /// The scan's symbols: id, rank of the pair it starts (`u32::MAX`:
    /// none), that pair's merged id.
    parts: Vec<(u32, u32, u32)>,
}

/// Longest piece (bytes) merged by a scan rather than the heap.
const SCAN_MAX: usize = 48;

/// One symbol of the piece being merged; `len == 0` once absorbed by its
/// left neighbour (as in `tokenizers`).
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    len: u32,
}

/// No neighbour.
const NONE: u32 = u32::MAX;

/// Verdicts of [`Bpe::is_whole`].
const UNKNOWN: u8 = 0;
const WHOLE: u8 = 1;
const SPLIT: u8 = 2;

fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

impl Bpe {
    /// Builds the tables from the model section, given the byte-level
    /// byte → character table. `None` for a model this module does not
    /// handle exactly (see the module docs).
    pub(crate) fn from_model_json(model: &ModelJson<'_>, bytes_char: &[char; 256]) -> Option<Self> {
        let empty = |s: &Option<String>| s.as_deref().is_none_or(str::is_empty);
        if model.byte_fallback
            || model.unk_token.is_some()
            || !empty(&model.continuing_subword_prefix)
            || !empty(&model.end_of_word_suffix)
        {
            return None;
        }
        let mut byte_ids = [0u32; 256];
        let mut buf = [0u8; 4];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = *model.vocab.get(&*bytes_char[b].encode_utf8(&mut buf))?;
        }
        let mut merges = HashMap::with_capacity(model.merges.len());
        let mut joined = String::new();
        for (rank, merge) in model.merges.iter().enumerate() {
            let (a, b) = match merge {
                MergeJson::Line(line) => {
                    let mut parts = line.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(a), Some(b), None) => (a, b),
                        _ => return None,
                    }
                }
                MergeJson::Pair(a, b) => (&**a, &**b),
            };
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let (left, right, new) = (
                *model.vocab.get(a)?,
                *model.vocab.get(b)?,
                *model.vocab.get(joined.as_str())?,
            );
            merges.insert(pair(left, right), (u32::try_from(rank).ok()?, new));
        }
        let mut byte_pairs = vec![(u32::MAX, NONE); 1 << 16].into_boxed_slice();
        for (i, slot) in byte_pairs.iter_mut().enumerate() {
            let (l, r) = (byte_ids[i >> 8], byte_ids[i & 0xff]);
            if let Some(&m) = merges.get(&pair(l, r)) {
                *slot = m;
            }
        }
        let spellings = Self::spellings(&model.vocab, bytes_char);
        let verdict = if model.ignore_merges { WHOLE } else { UNKNOWN };
        let ids = model.vocab.values().max().map_or(0, |m| *m as usize + 1);
        Some(Bpe {
            byte_ids,
            merges,
            byte_pairs,
            spellings,
            verdicts: (0..ids).map(|_| AtomicU8::new(verdict)).collect(),
        })
    }

    /// Every token of two or more bytes, by its bytes (a token whose
    /// characters are not all byte-level characters cannot be a piece's
    /// spelling and is left out).
    fn spellings(vocab: &Vocab<'_>, bytes_char: &[char; 256]) -> HashMap<Box<[u8]>, u32> {
        let mut char_byte = HashMap::with_capacity(256);
        for (b, c) in (0u8..=255).zip(bytes_char) {
            char_byte.insert(*c, b);
        }
        vocab
            .iter()
            .filter_map(|(token, &id)| {
                let bytes = token
                    .chars()
                    .map(|c| char_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()?;
                (bytes.len() > 1).then(|| (bytes.into_boxed_slice(), id))
            })
            .collect()
    }

    /// Whether a piece spelling token `id` encodes as that one token: always
    /// with `ignore_merges`; else when the merges, run once for this token
    /// and remembered, end in it (most tokens; a few merge differently).
    fn is_whole(&self, id: u32, piece: &[u8], scratch: &mut Scratch) -> bool {
        let Some(verdict) = self.verdicts.get(id as usize) else {
            return false;
        };
        match verdict.load(Ordering::Relaxed) {
            WHOLE => true,
            SPLIT => false,
            _ => {
                let mut ids = Vec::new();
                self.merge(piece, scratch, &mut ids);
                let whole = ids == [id];
                verdict.store(if whole { WHOLE } else { SPLIT }, Ordering::Relaxed);
                whole
            }
        }
    }

    /// Appends the ids of one pre-token (raw bytes, before the byte-level
    /// mapping) to `out`.
    pub(crate) fn encode(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        match piece {
            [] => return,
            [b] => {
                out.push(self.byte_ids[usize::from(*b)]);
                return;
            }
            _ => {}
        }
        if let Some(&id) = self.spellings.get(piece)
            && self.is_whole(id, piece, scratch)
        {
            out.push(id);
            return;
        }
        self.merge(piece, scratch, out);
    }

    /// The merge loop (see the module docs), for a piece of two or more
    /// bytes: a scan for short pieces, the heap for long ones.
    fn merge(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if piece.len() <= SCAN_MAX {
            self.merge_scan(piece, scratch, out);
        } else {
            self.merge_heap(piece, scratch, out);
        }
    }

    /// The rank and merged id of the pair `left right`, if they merge.
    fn ranked(&self, left: u32, right: u32) -> (u32, u32) {
        self.merges
            .get(&pair(left, right))
            .copied()
            .unwrap_or((u32::MAX, NONE))
    }

    /// The merge loop as a scan: each round merges the lowest-ranked pair,
    /// the leftmost of equals, which is the candidate the heap would pop
    /// (a stale heap entry can never pass for a live one: every merge
    /// lengthens the pair's spelling, so its merged id changes). Each
    /// symbol keeps the rank of the pair it starts; a merge looks up only
    /// the two pairs it changes. Quadratic in the piece's length, but on
    /// short pieces (most of them) cheaper than the heap's pushes, pops
    /// and re-checks.
    fn merge_scan(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let parts = &mut scratch.parts;
        parts.clear();
        parts.extend(
            piece
                .iter()
                .map(|b| (self.byte_ids[usize::from(*b)], u32::MAX, NONE)),
        );
        for (part, w) in parts.iter_mut().zip(piece.windows(2)) {
            (part.1, part.2) = self.byte_pairs[usize::from(w[0]) << 8 | usize::from(w[1])];
        }
        loop {
            let mut best = (u32::MAX, 0);
            for (i, p) in parts.iter().enumerate() {
                if p.1 < best.0 {
                    best = (p.1, i);
                }
            }
            let (rank, i) = best;
            if rank == u32::MAX {
                break;
            }
            parts[i].0 = parts[i].2;
            parts.remove(i + 1);
            let (rank, new) = match parts.get(i + 1) {
                Some(next) => self.ranked(parts[i].0, next.0),
                None => (u32::MAX, NONE),
            };
            parts[i].1 = rank;
            parts[i].2 = new;
            if i > 0 {
                let (rank, new) = self.ranked(parts[i - 1].0, parts[i].0);
                parts[i - 1].1 = rank;
                parts[i - 1].2 = new;
            }
        }
        out.extend(parts.iter().map(|p| p.0));
    }

    /// The merge loop with a heap of candidates, as `tokenizers` runs it.
    fn merge_heap(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let Scratch { symbols, heap, .. } = scratch;
        symbols.clear();
        heap.clear();
        let n = u32::try_from(piece.len()).unwrap_or(u32::MAX);
        symbols.extend(piece.iter().zip(0u32..).map(|(b, i)| Symbol {
            id: self.byte_ids[usize::from(*b)],
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            len: 1,
        }));
        for (pos, w) in (0u32..).zip(piece.windows(2)) {
            let (rank, new) = self.byte_pairs[usize::from(w[0]) << 8 | usize::from(w[1])];
            if rank != u32::MAX {
                heap.push(Reverse((rank, pos, new)));
            }
        }
        while let Some(Reverse((_, pos, new))) = heap.pop() {
            let left = symbols[pos as usize];
            if left.len == 0 || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            if self
                .merges
                .get(&pair(left.id, right.id))
                .is_none_or(|&(_, id)| id != new)
            {
                continue;
            }
            let merged = Symbol {
                id: new,
                prev: left.prev,
                next: right.next,
                len: left.len + right.len,
            };
            symbols[pos as usize] = merged;
            symbols[left.next as usize].len = 0;
            if merged.next != NONE {
                symbols[merged.next as usize].prev = pos;
                let after = symbols[merged.next as usize];
                if let Some(&(rank, id)) = self.merges.get(&pair(new, after.id)) {
                    heap.push(Reverse((rank, pos, id)));
                }
            }
            if merged.prev != NONE {
                let before = symbols[merged.prev as usize];
                if let Some(&(rank, id)) = self.merges.get(&pair(before.id, new)) {
                    heap.push(Reverse((rank, merged.prev, id)));
                }
            }
        }
        let mut at = 0;
        while at != NONE {
            let s = symbols[at as usize];
            out.push(s.id);
            at = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A toy byte-level model: bytes map to themselves for ASCII letters.
    fn toy(merges: &serde_json::Value, ignore_merges: bool) -> Bpe {
        let table = crate::fast::bytes_char();
        let mut vocab: serde_json::Map<String, serde_json::Value> = table
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), json!(i)))
            .collect();
        for (i, t) in ["ab", "bc", "abc", "aa", "aaa", "xyz"].iter().enumerate() {
            vocab.insert((*t).to_owned(), json!(256 + i));
        }
        let text = json!({
            "vocab": vocab, "merges": merges, "ignore_merges": ignore_merges,
        })
        .to_string();
        Bpe::from_model_json(&serde_json::from_str(&text).unwrap(), &table).unwrap()
    }

    fn ids(bpe: &Bpe, s: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.encode(s.as_bytes(), &mut Scratch::default(), &mut out);
        out
    }

    #[test]
    fn lower_rank_merges_first_and_ties_go_left() {
        // "bc" outranks "ab": "abc" → a + bc, never ab + c.
        let bpe = toy(&json!(["b c", "a b", "a bc"]), false);
        assert_eq!(ids(&bpe, "abc"), [258]);
        let bpe = toy(&json!([["b", "c"], ["a", "b"]]), false);
        assert_eq!(ids(&bpe, "abc"), [u32::from(b'a'), 257]);
        // "aaa" with only a+a: the leftmost pair merges first.
        let bpe = toy(&json!(["a a"]), false);
        assert_eq!(ids(&bpe, "aaa"), [259, u32::from(b'a')]);
        assert_eq!(ids(&bpe, "aaaa"), [259, 259]);
    }

    #[test]
    fn the_scan_and_the_heap_merge_alike() {
        // Overlapping merges of several ranks over a three-letter alphabet,
        // pieces up to twice the scan's limit.
        let bpe = toy(&json!(["a a", "b c", "a b", "aa a", "a bc", "ab c"]), false);
        let mut seed = 7u64;
        for len in 2..2 * SCAN_MAX {
            for _ in 0..20 {
                let piece: Vec<u8> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        b"abc"[((seed >> 33) % 3) as usize]
                    })
                    .collect();
                let (mut scan, mut heap) = (Vec::new(), Vec::new());
                let mut scratch = Scratch::default();
                bpe.merge_scan(&piece, &mut scratch, &mut scan);
                bpe.merge_heap(&piece, &mut scratch, &mut heap);
                assert_eq!(scan, heap, "{}", String::from_utf8_lossy(&piece));
            }
        }
    }

    #[test]
    fn ignore_merges_takes_a_whole_token() {
        // No merge builds "xyz", but with ignore_merges the piece is a token.
        assert_eq!(ids(&toy(&json!([]), true), "xyz"), [261]);
        assert_eq!(
            ids(&toy(&json!([]), false), "xyz"),
            [u32::from(b'x'), u32::from(b'y'), u32::from(b'z')]
        );
    }

    #[test]
    fn models_it_cannot_match_are_refused() {
        let table = crate::fast::bytes_char();
        let text = json!({"vocab": {"a": 0}, "merges": []}).to_string();
        let model = serde_json::from_str(&text).unwrap();
        assert!(
            Bpe::from_model_json(&model, &table).is_none(),
            "bytes missing"
        );
        let mut vocab = serde_json::Map::new();
        for (i, c) in table.iter().enumerate() {
            vocab.insert(c.to_string(), json!(i));
        }
        for extra in [
            json!({"byte_fallback": true}),
            json!({"unk_token": "<unk>"}),
            json!({"continuing_subword_prefix": "##"}),
            json!({"merges": ["a b c"]}),
            json!({"merges": ["a q!"]}),
        ] {
            let mut m = json!({"vocab": vocab, "merges": []});
            for (k, v) in extra.as_object().unwrap() {
                m[k] = v.clone();
            }
            let text = m.to_string();
            let model = serde_json::from_str(&text).unwrap();
            assert!(Bpe::from_model_json(&model, &table).is_none(), "{extra}");
        }
    }
}
