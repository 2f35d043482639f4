//! The tokenizer an engine serves with, and cheap output tokens.
//!
//! A simulated engine never runs a model, so its output tokens are drawn
//! from a fixed table of *plain word* tokens: ids whose text is known in
//! advance, so streaming a token costs a table lookup, never a
//! detokenization. With the word-level tokenizer the table is the numbered
//! words `w0 … w65535` (id = base + n, text = `w{n}`), and output text
//! re-tokenizes to exactly the generated ids, so a multi-turn client that
//! sends the answer back hits the engine's cache on it as on a real engine.

use std::borrow::Cow;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use kinference_tokenize::{LoadError, ModelTokenizer, Options, word_level};

/// Most entries kept in a plain-word table for a real tokenizer.
const TABLE_SIZE: usize = 4096;
/// Ids scanned to fill that table.
const SCAN_LIMIT: u32 = 200_000;

/// A tokenizer plus the output vocabulary drawn from it. Load once, share
/// (`Arc`) between all engines of a process.
#[derive(Debug)]
pub struct SimTokenizer {
    tokenizer: Arc<ModelTokenizer>,
    output: Output,
}

#[derive(Debug)]
enum Output {
    /// `w{n}` has id `base + n`.
    Numbered { base: u32, count: u32 },
    /// Ids and their decoded text.
    Table(Vec<(u32, Box<str>)>),
}

impl SimTokenizer {
    /// The word-level tokenizer of `kinference-tokenize`, loaded once per
    /// process.
    pub fn word_level() -> Arc<SimTokenizer> {
        static WORD_LEVEL: OnceLock<Arc<SimTokenizer>> = OnceLock::new();
        WORD_LEVEL
            .get_or_init(|| {
                let tokenizer = word_level::load(Options::default()).unwrap_or_else(|e| {
                    unreachable!("the generated word-level tokenizer loads: {e}")
                });
                Arc::new(SimTokenizer::new(Arc::new(tokenizer)))
            })
            .clone()
    }

    /// Loads `tokenizer.json` (and `tokenizer_config.json`, chat template)
    /// from a model directory.
    ///
    /// # Errors
    /// [`LoadError`] when the files are missing or malformed.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<SimTokenizer, LoadError> {
        Ok(SimTokenizer::new(Arc::new(ModelTokenizer::from_dir(dir)?)))
    }

    /// Wraps a loaded tokenizer and builds its output vocabulary: the
    /// numbered words when present, else up to 4096 ids that decode to a
    /// space and a short lower-case ASCII word.
    pub fn new(tokenizer: Arc<ModelTokenizer>) -> SimTokenizer {
        let output = if tokenizer.token_to_id("w0") == Some(word_level::NUMBERED_WORD_BASE)
            && tokenizer.token_to_id("w65535")
                == Some(word_level::NUMBERED_WORD_BASE + word_level::NUMBERED_WORDS - 1)
        {
            Output::Numbered {
                base: word_level::NUMBERED_WORD_BASE,
                count: word_level::NUMBERED_WORDS,
            }
        } else {
            Output::Table(plain_words(&tokenizer))
        };
        SimTokenizer { tokenizer, output }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<ModelTokenizer> {
        &self.tokenizer
    }

    /// An output token id for the random draw `r`.
    pub fn token(&self, r: u64) -> u32 {
        match &self.output {
            Output::Numbered { base, count } => base + (r % u64::from(*count)) as u32,
            Output::Table(t) if !t.is_empty() => t[(r % t.len() as u64) as usize].0,
            Output::Table(_) => 0,
        }
    }

    /// The text of an output token; `first` drops the joining space of the
    /// numbered words.
    pub fn text(&self, id: u32, first: bool) -> Cow<'_, str> {
        match &self.output {
            Output::Numbered { base, count } if id >= *base && id - base < *count => {
                let n = id - base;
                Cow::Owned(if first {
                    format!("w{n}")
                } else {
                    format!(" w{n}")
                })
            }
            Output::Table(t) => t
                .binary_search_by_key(&id, |(i, _)| *i)
                .map_or(Cow::Borrowed(""), |at| Cow::Borrowed(&*t[at].1)),
            Output::Numbered { .. } => Cow::Borrowed(""),
        }
    }

    /// Appends the text of `id` to `out`.
    pub fn push_text(&self, id: u32, first: bool, out: &mut String) {
        match &self.output {
            Output::Numbered { base, count } if id >= *base && id - base < *count => {
                use std::fmt::Write as _;
                let _ = write!(out, "{}w{}", if first { "" } else { " " }, id - base);
            }
            _ => out.push_str(&self.text(id, first)),
        }
    }

    /// Size of the output vocabulary.
    pub fn output_vocabulary(&self) -> usize {
        match &self.output {
            Output::Numbered { count, .. } => *count as usize,
            Output::Table(t) => t.len(),
        }
    }
}

fn plain_words(tokenizer: &ModelTokenizer) -> Vec<(u32, Box<str>)> {
    let limit = (tokenizer.vocab_size() as u32).min(SCAN_LIMIT);
    let mut table = Vec::new();
    for id in 0..limit {
        let Ok(text) = tokenizer.decode(&[id]) else {
            continue;
        };
        let word = text.strip_prefix(' ').unwrap_or("");
        if (3..=8).contains(&word.len()) && word.bytes().all(|b| b.is_ascii_lowercase()) {
            table.push((id, text.into_boxed_str()));
            if table.len() == TABLE_SIZE {
                break;
            }
        }
    }
    // Table lookups by id use binary search order.
    table.sort_by_key(|(id, _)| *id);
    table
}

/// SplitMix64: a tiny, fast, seedable generator (no dependency needed).
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_words_round_trip_through_the_tokenizer() {
        let t = SimTokenizer::word_level();
        let mut rng = Rng::new(7);
        let ids: Vec<u32> = (0..20).map(|_| t.token(rng.next_u64())).collect();
        let mut text = String::new();
        for (i, id) in ids.iter().enumerate() {
            t.push_text(*id, i == 0, &mut text);
        }
        assert_eq!(t.tokenizer().encode(&text, false).expect("encodes"), ids);
        assert_eq!(t.text(ids[1], false), format!(" {}", t.text(ids[1], true)));
    }

    #[test]
    fn rng_is_deterministic_and_spread() {
        let a: Vec<u64> = {
            let mut r = Rng::new(1);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(1);
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        let mut r = Rng::new(2);
        let mean = (0..10_000).map(|_| r.next_f64()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}
