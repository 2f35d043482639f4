//! Where a text may be cut so that tokenizing the pieces separately gives
//! exactly the ids of tokenizing the whole.
//!
//! The `tokenizers` pipeline first splits the raw text on added tokens
//! (leftmost-longest matching over all non-normalized added tokens, then
//! each match's `single_word`/`lstrip`/`rstrip` rules), and only then
//! normalizes, pre-tokenizes and runs the model on each piece in between.
//! A position `p` where an added token is matched is therefore a hard
//! boundary: no BPE merge, normalizer or pre-tokenizer ever sees text from
//! both sides of it. Cutting at `p` is exact when the match at `p` does not
//! depend on the text before `p`, which holds when:
//!
//! 1. the longest added token starting at `p` (the leftmost-longest
//!    winner) is an *anchor*: not normalized, no `lstrip`, `rstrip` or
//!    `single_word`, its first character ASCII and neither whitespace nor a
//!    word character (so neighbours' `single_word` checks and strips see the
//!    same thing with or without the cut), its last character not
//!    whitespace;
//! 2. no added-token occurrence starts before `p` and ends after it (which
//!    would win the leftmost-longest race, or be discarded and skip `p`).
//!
//! Condition 2 is checked with an overlapping Aho-Corasick scan over all
//! non-normalized added tokens. Special-token strings such as
//! `<|im_start|>`, `[INST]` or `</s>` are the usual anchors, so a rendered
//! chat splits at every turn. With `split_special_tokens` (special tokens
//! encoded as text) no cut is made.

use aho_corasick::{AhoCorasick, MatchKind};

/// Finds the exact cut points of texts for one tokenizer.
#[derive(Debug)]
pub(crate) struct Segmenter {
    /// All non-normalized added tokens (overlapping scan), or `None` when
    /// no cut is ever safe.
    matcher: Option<AhoCorasick>,
    /// Per pattern: may a cut be made before it.
    anchor: Vec<bool>,
}

impl Segmenter {
    /// Builds the matcher from the tokenizer's added vocabulary.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Self {
        let none = Segmenter {
            matcher: None,
            anchor: Vec::new(),
        };
        if tokenizer.get_encode_special_tokens() {
            return none;
        }
        let mut tokens: Vec<tokenizers::AddedToken> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| !t.normalized && !t.content.is_empty())
            .collect();
        tokens.sort_by(|a, b| a.content.cmp(&b.content));
        tokens.dedup_by(|a, b| a.content == b.content);
        let anchor: Vec<bool> = tokens.iter().map(is_anchor).collect();
        if !anchor.iter().any(|a| *a) {
            return none;
        }
        let Ok(matcher) = AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .build(tokens.iter().map(|t| t.content.as_bytes()))
        else {
            return none;
        };
        Segmenter {
            matcher: Some(matcher),
            anchor,
        }
    }

    /// Whether any cut can ever be made.
    pub(crate) fn can_cut(&self) -> bool {
        self.matcher.is_some()
    }

    /// Appends the cut points of `text` to `out`: strictly increasing byte
    /// offsets, each on a character boundary, none at 0 or `text.len()`.
    pub(crate) fn cut_points(&self, text: &str, out: &mut Vec<usize>) {
        let Some(matcher) = &self.matcher else {
            return;
        };
        // (start, end, pattern) of every occurrence, overlapping ones too.
        let mut found: Vec<(usize, usize, usize)> = matcher
            .find_overlapping_iter(text)
            .map(|m| (m.start(), m.end(), m.pattern().as_usize()))
            .collect();
        if found.is_empty() {
            return;
        }
        found.sort_unstable_by_key(|&(start, end, _)| (start, std::cmp::Reverse(end)));
        // Furthest end among occurrences that start before the candidate.
        let mut reach = 0;
        let mut i = 0;
        while i < found.len() {
            let (start, _, pattern) = found[i];
            // found[i] is the longest occurrence at `start` (sorted by end
            // descending within a start): the one leftmost-longest picks.
            if start > 0 && start < text.len() && reach <= start && self.anchor[pattern] {
                out.push(start);
            }
            while i < found.len() && found[i].0 == start {
                reach = reach.max(found[i].1);
                i += 1;
            }
        }
    }
}

/// Whether a cut may be made right before this token (see the module docs).
fn is_anchor(token: &tokenizers::AddedToken) -> bool {
    let first = token.content.chars().next();
    let last = token.content.chars().next_back();
    !token.normalized
        && !token.lstrip
        && !token.rstrip
        && !token.single_word
        && first.is_some_and(|c| c.is_ascii() && !c.is_ascii_whitespace() && !c.is_ascii_alphanumeric() && c != '_')
        && last.is_some_and(|c| !c.is_whitespace())
}

#[cfg(test)]
mod tests {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::{AddedToken, Tokenizer};

    use super::*;

    fn tokenizer(tokens: Vec<AddedToken>) -> Tokenizer {
        let mut t = Tokenizer::new(
            WordLevel::builder()
                .vocab([("<unk>".to_string(), 0)].into_iter().collect())
                .unk_token("<unk>".into())
                .build()
                .unwrap(),
        );
        t.add_special_tokens(tokens).unwrap();
        t
    }

    fn cuts(seg: &Segmenter, text: &str) -> Vec<usize> {
        let mut out = Vec::new();
        seg.cut_points(text, &mut out);
        out
    }

    #[test]
    fn cuts_before_anchors_only() {
        let seg = Segmenter::new(&tokenizer(vec![
            AddedToken::from("<a>", true),
            AddedToken::from("<a>x>", true),
            AddedToken::from("<l>", true).lstrip(true),
            AddedToken::from("w", true),
            AddedToken::from("x<", true),
        ]));
        assert!(seg.can_cut());
        // Plain anchors.
        assert_eq!(cuts(&seg, "a<a>b<a>"), vec![1, 5]);
        // At the start or end of the text there is nothing to cut.
        assert_eq!(cuts(&seg, "<a>"), Vec::<usize>::new());
        // The longest token at 1 is `<a>x>`, itself an anchor.
        assert_eq!(cuts(&seg, "q<a>x>"), vec![1]);
        // `x<` straddles 2: the `<a>` at 2 may lose the leftmost race.
        assert_eq!(cuts(&seg, "qx<a>"), Vec::<usize>::new());
        // lstrip tokens, and tokens starting with a word character, are not anchors.
        assert_eq!(cuts(&seg, "q <l>r w"), Vec::<usize>::new());
    }

    #[test]
    fn no_cuts_without_anchors() {
        let seg = Segmenter::new(&tokenizer(vec![AddedToken::from(" x", true)]));
        assert!(!seg.can_cut());
        assert_eq!(cuts(&seg, "a x b"), Vec::<usize>::new());
    }
}
