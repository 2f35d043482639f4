//! A faster route through the common byte-level BPE pipelines, with the
//! same ids.
//!
//! `tokenizers` runs every pre-token through `NormalizedString` machinery
//! (alignment vectors per character) and evaluates the `Split` regex with
//! `fancy-regex`, whose backtracking VM is needed only for one alternative,
//! `\s+(?!\S)`. On an 8K-token prompt that is most of the time spent. For
//! text that contains no added token, this module does the same work
//! directly: the normalizer (none, or NFC, applied with the same crate and
//! tables `tokenizers` uses, and skipped when the text is already in NFC),
//! the split with the `regex` crate, and the merges of each piece on its
//! raw bytes ([`crate::bpe`], which stands in for the GPT-2
//! byte-to-character mapping and the tokenizer's BPE model; a model it does
//! not match exactly keeps the mapping and `tokenizers`' model). Anything
//! else (another normalizer or pre-tokenizer, a BPE with dropout) is not
//! handled here and goes through the pipeline.
//!
//! # The lookahead
//!
//! A pattern `P|\s+(?!\S)|\s+` (the Split regex of Qwen2/3, Llama 3,
//! Mistral Tekken, and GPT-2's built-in one) is run as `P|\s+`, which the
//! `regex` crate supports and which it evaluates with the same
//! leftmost-first preference as a backtracking engine. The two differ only
//! where the final `\s+` matches (no alternative of `P` matches there): it
//! takes the whole whitespace run; `\s+(?!\S)` would have given the run
//! minus its last character when the run has at least two characters and is
//! followed by a non-space, and otherwise the same. So a match that is all
//! whitespace, at least two characters, not at the end of the text, and
//! where `P` does not match at its start (checked with `\A(?:P)`), is
//! shortened by its last character and the search continues from there.
//! The `cache_equivalence` and `fast_path` tests compare this route with the
//! pipeline on random text.

use regex::Regex;
use regex_automata::util::pool::Pool;
use regex_automata::{Anchored, Input, meta};
use serde::Deserialize;
use serde_json::Value as Json;
use tokenizers::{Model, ModelWrapper};
use unicode_normalization_alignments::UnicodeNormalization;

use crate::bpe::{Bpe, ModelJson, Scratch};

/// The lookahead tail this module knows how to emulate.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// GPT-2's built-in `ByteLevel` split (`use_regex: true`).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The parts of `tokenizer.json` the fast route depends on (the vocabulary
/// and merges are skipped without being built).
#[derive(Deserialize)]
struct Shape {
    #[serde(default)]
    normalizer: Json,
    #[serde(default)]
    pre_tokenizer: Json,
    model: ModelShape,
    #[serde(default)]
    added_tokens: Vec<Json>,
}

#[derive(Deserialize)]
struct ModelShape {
    #[serde(rename = "type", default)]
    kind: Json,
    #[serde(default)]
    dropout: Json,
}

/// The fast route for one tokenizer, if its pipeline is one it knows.
pub(crate) struct FastPath {
    /// Whether the pipeline normalizes to NFC (text the quick check does
    /// not pass is normalized before the split).
    nfc: bool,
    /// `P|\s+`, searched anchored where the last piece ended (every
    /// character starts a match of the patterns in use, so that is the
    /// usual case and needs no reverse scan), else unanchored.
    split: meta::Regex,
    /// Search caches for `split`, one taken per text rather than per
    /// piece: the regex's own pool is lock-free only for the thread that
    /// first used it, and every other runtime worker took its mutex twice
    /// per piece (thousands of times for a long prompt).
    caches: Pool<meta::Cache, CacheFn>,
    /// `\A(?:P)`.
    prefix: Regex,
    /// GPT-2's byte → character table.
    bytes_char: [char; 256],
    /// The merges on raw bytes, when the model is one `Bpe` matches
    /// exactly; else each piece goes through the `tokenizers` model.
    bpe: Option<Bpe>,
}

/// Makes a search cache for [`FastPath::split`].
type CacheFn = Box<dyn Fn() -> meta::Cache + Send + Sync>;

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("nfc", &self.nfc)
            .field("split", &self.split)
            .field("bpe", &self.bpe.is_some())
            .finish_non_exhaustive()
    }
}

/// The model section again, this time with its vocabulary and merges.
#[derive(Deserialize)]
struct WithModel<'a> {
    #[serde(borrow)]
    model: ModelJson<'a>,
}

impl FastPath {
    /// Recognises the pipeline from the bytes of `tokenizer.json`.
    pub(crate) fn from_tokenizer_bytes(bytes: &[u8]) -> Option<Self> {
        let shape: Shape = serde_json::from_slice(bytes).ok()?;
        let mut fast = Self::from_tokenizer_json(&serde_json::json!({
            "normalizer": shape.normalizer,
            "pre_tokenizer": shape.pre_tokenizer,
            "model": {"type": shape.model.kind, "dropout": shape.model.dropout},
            "added_tokens": shape.added_tokens,
        }))?;
        fast.bpe = serde_json::from_slice::<WithModel<'_>>(bytes)
            .ok()
            .and_then(|m| Bpe::from_model_json(&m.model, &fast.bytes_char));
        Some(fast)
    }

    /// Recognises the pipeline from `tokenizer.json`: no normalizer or NFC;
    /// `Sequence[Split(Regex P, Isolated), ByteLevel(no prefix space, no
    /// regex)]` or `ByteLevel(no prefix space, regex)`; a BPE model without
    /// dropout; no normalized added tokens. `None` otherwise.
    pub(crate) fn from_tokenizer_json(json: &Json) -> Option<Self> {
        let nfc = match &json["normalizer"] {
            Json::Null => false,
            n if n["type"] == "NFC" => true,
            _ => return None,
        };
        let model = &json["model"];
        if model["type"] != "BPE" || !(model["dropout"].is_null() || model["dropout"] == 0.0) {
            return None;
        }
        let normalized_added = json["added_tokens"]
            .as_array()?
            .iter()
            .any(|t| t["normalized"] != false);
        if normalized_added {
            return None;
        }
        let plain_byte_level = |p: &Json, use_regex: bool| {
            p["type"] == "ByteLevel"
                && p["add_prefix_space"] == false
                && p["use_regex"] == use_regex
        };
        let pre = &json["pre_tokenizer"];
        let pattern = if plain_byte_level(pre, true) {
            GPT2_PATTERN
        } else if pre["type"] == "Sequence" {
            match pre["pretokenizers"].as_array()?.as_slice() {
                [split, byte_level]
                    if split["type"] == "Split"
                        && split["behavior"] == "Isolated"
                        && split["invert"] == false
                        && plain_byte_level(byte_level, false) =>
                {
                    split["pattern"]["Regex"].as_str()?
                }
                _ => return None,
            }
        } else {
            return None;
        };
        let prefix = pattern.strip_suffix(LOOKAHEAD_TAIL)?;
        // Anchors and word boundaries would see different context in the
        // anchored re-check; the patterns in use have none.
        if [r"\b", r"\B", r"\A", r"\z", "$", "(?"]
            .iter()
            .any(|t| prefix.replace("(?i:", "").contains(t))
            || prefix.matches('^').count() != prefix.matches("[^").count()
        {
            return None;
        }
        let split = meta::Regex::new(&format!(r"{prefix}|\s+")).ok()?;
        let for_caches = split.clone();
        Some(FastPath {
            nfc,
            split,
            caches: Pool::new(Box::new(move || for_caches.create_cache())),
            prefix: Regex::new(&format!(r"\A(?:{prefix})")).ok()?,
            bytes_char: bytes_char(),
            bpe: None,
        })
    }

    /// Appends the ids of `text`, which must contain no added token, to
    /// `out` (left as it was on an error of the `tokenizers` model).
    pub(crate) fn encode_plain(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        // The NFC normalizer runs on the whole plain text before the split,
        // with the same crate `tokenizers` uses. Where the quick check
        // cannot tell, the text is normalized once (NFC text comes back
        // unchanged), not checked by normalizing and then normalized again.
        let normalized: String;
        let text = if self.nfc
            && !text.is_ascii()
            && unicode_normalization_alignments::is_nfc_quick(text.chars())
                != unicode_normalization_alignments::IsNormalized::Yes
        {
            normalized = text.nfc().map(|(c, _)| c).collect();
            normalized.as_str()
        } else {
            text
        };
        let before = out.len();
        if let Some(bpe) = &self.bpe {
            let mut scratch = Scratch::default();
            let result = self.for_each_piece(text, |piece| {
                bpe.encode(piece.as_bytes(), &mut scratch, out);
                Ok(())
            });
            return result;
        }
        let mut mapped = String::new();
        let result = self.for_each_piece(text, |piece| {
            mapped.clear();
            mapped.extend(piece.bytes().map(|b| self.bytes_char[b as usize]));
            let tokens = model.tokenize(&mapped)?;
            out.extend(tokens.iter().map(|t| t.id));
            Ok(())
        });
        if result.is_err() {
            out.truncate(before);
        }
        result
    }

    /// Calls `f` on each pre-token of `text`, as the Split pre-tokenizer
    /// would cut it (matches and the gaps between them, in order).
    fn for_each_piece(
        &self,
        text: &str,
        mut f: impl FnMut(&str) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<()> {
        let mut cache = self.caches.get();
        let mut pos = 0;
        while pos < text.len() {
            let at = Input::new(text).range(pos..);
            let found = self
                .split
                .search_with(&mut cache, &at.clone().anchored(Anchored::Yes))
                .or_else(|| self.split.search_with(&mut cache, &at));
            let Some(m) = found else {
                return f(&text[pos..]);
            };
            let (start, mut end) = (m.start(), m.end());
            if start > pos {
                f(&text[pos..start])?;
            }
            let matched = &text[start..end];
            if end < text.len()
                && matched.chars().nth(1).is_some()
                && matched.chars().all(char::is_whitespace)
                && !self.prefix.is_match(&text[start..])
            {
                // `\s+(?!\S)`: give the run's last character back.
                end -= matched.chars().next_back().map_or(0, char::len_utf8);
            }
            f(&text[start..end])?;
            pos = end;
        }
        Ok(())
    }

    #[cfg(test)]
    fn pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        let mut pos = 0;
        self.for_each_piece(text, |p| {
            // `p` is a subslice of `text`: recover it with its position.
            let start = pos;
            pos += p.len();
            out.push(&text[start..pos]);
            Ok(())
        })
        .unwrap();
        out
    }
}

/// GPT-2's reversible byte → printable character table.
pub(crate) fn bytes_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let code = if printable {
            u32::from(b)
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(code).unwrap_or('\0');
    }
    table
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn qwen_like() -> FastPath {
        FastPath::from_tokenizer_json(&json!({
            "normalizer": {"type": "NFC"},
            "added_tokens": [],
            "model": {"type": "BPE", "dropout": null},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]}
        }))
        .unwrap()
    }

    #[test]
    fn lookahead_is_emulated() {
        let f = qwen_like();
        assert_eq!(f.pieces("a   b"), ["a", "  ", " b"]);
        assert_eq!(f.pieces("a b"), ["a", " b"]);
        assert_eq!(f.pieces("a   "), ["a", "   "]);
        assert_eq!(f.pieces("x \n\n  y"), ["x", " \n\n", " ", " y"]);
        assert_eq!(f.pieces("I'M 12"), ["I", "'M", " ", "1", "2"]);
        assert_eq!(f.pieces("\t\t!"), ["\t", "\t", "!"]);
    }

    #[test]
    fn unknown_pipelines_are_refused() {
        let mut j = json!({
            "normalizer": null, "added_tokens": [], "model": {"type": "BPE", "dropout": null},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}
        });
        assert!(FastPath::from_tokenizer_json(&j).is_some());
        j["pre_tokenizer"]["add_prefix_space"] = json!(true);
        assert!(FastPath::from_tokenizer_json(&j).is_none());
        j["pre_tokenizer"]["add_prefix_space"] = json!(false);
        j["normalizer"] = json!({"type": "Lowercase"});
        assert!(FastPath::from_tokenizer_json(&j).is_none());
        j["normalizer"] = json!(null);
        j["model"]["dropout"] = json!(0.1);
        assert!(FastPath::from_tokenizer_json(&j).is_none());
        j["model"]["dropout"] = json!(null);
        j["added_tokens"] = json!([{"content": "x", "normalized": true}]);
        assert!(FastPath::from_tokenizer_json(&j).is_none());
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let t = bytes_char();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0xAD], '\u{143}');
        let mut all: Vec<char> = t.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn the_real_tokenizers_merge_on_bytes() {
        for model in ["qwen3", "mistral-nemo-instruct-2407", "gpt2"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../testdata/tokenizers")
                .join(model)
                .join("tokenizer.json");
            let bytes = std::fs::read(&path).unwrap();
            let fast = FastPath::from_tokenizer_bytes(&bytes).expect(model);
            assert!(fast.bpe.is_some(), "{model}");
        }
    }
}
