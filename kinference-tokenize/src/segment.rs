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
    /// All non-normalized added tokens (overlapping scan), or `None`
    /// without any.
    matcher: Option<AhoCorasick>,
    /// Per pattern: may a cut be made before it.
    anchor: Vec<bool>,
    /// Per pattern: its token id.
    id: Vec<u32>,
    /// Whether cuts are made at all (not with `split_special_tokens`).
    cuts: bool,
}

/// One piece of a text between cut points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Byte range in the text.
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// The anchor token the segment starts with (it is matched as that
    /// token): its id and length in bytes.
    pub(crate) lead: Option<(u32, usize)>,
    /// No added-token occurrence after the lead: the rest is one plain
    /// piece for the normalizer, pre-tokenizer and model. Only meaningful
    /// when the tokenizer has no normalized added tokens.
    pub(crate) plain: bool,
}

impl Segmenter {
    /// Builds the matcher from the tokenizer's added vocabulary.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Self {
        let mut tokens: Vec<(u32, tokenizers::AddedToken)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.normalized && !t.content.is_empty())
            .collect();
        tokens.sort_by(|a, b| a.1.content.cmp(&b.1.content));
        tokens.dedup_by(|a, b| a.1.content == b.1.content);
        let matcher = if tokens.is_empty() {
            None
        } else {
            AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                .build(tokens.iter().map(|(_, t)| t.content.as_bytes()))
                .ok()
        };
        let anchor: Vec<bool> = tokens.iter().map(|(_, t)| is_anchor(t)).collect();
        // The id the pipeline gives the content (its added-tokens map).
        let id = tokens
            .iter()
            .map(|(id, t)| tokenizer.token_to_id(&t.content).unwrap_or(*id))
            .collect();
        Segmenter {
            cuts: matcher.is_some()
                && !tokenizer.get_encode_special_tokens()
                && anchor.iter().any(|a| *a),
            matcher,
            anchor,
            id,
        }
    }

    /// Whether any cut can ever be made.
    pub(crate) fn can_cut(&self) -> bool {
        self.cuts
    }

    /// Appends the segments of `text` to `out`: contiguous, in order,
    /// covering the text (none for an empty text). Each starts at 0 or at
    /// an exact cut point.
    pub(crate) fn segments(&self, text: &str, out: &mut Vec<Segment>) {
        if text.is_empty() {
            return;
        }
        let Some(matcher) = &self.matcher else {
            out.push(Segment {
                start: 0,
                end: text.len(),
                lead: None,
                plain: true,
            });
            return;
        };
        // (start, end, pattern) of every occurrence, overlapping ones too,
        // sorted by start, longest first.
        let mut found: Vec<(usize, usize, usize)> = matcher
            .find_overlapping_iter(text)
            .map(|m| (m.start(), m.end(), m.pattern().as_usize()))
            .collect();
        found.sort_unstable_by_key(|&(start, end, _)| (start, std::cmp::Reverse(end)));

        let first = out.len();
        out.push(Segment {
            start: 0,
            end: text.len(),
            lead: None,
            plain: true,
        });
        // Furthest end among occurrences that start before the candidate.
        let mut reach = 0;
        let mut i = 0;
        while i < found.len() {
            let (start, end, pattern) = found[i];
            // found[i] is the longest occurrence at `start`: the one
            // leftmost-longest matching picks (if nothing straddles).
            let anchored = reach <= start && self.anchor[pattern];
            let current = out
                .last_mut()
                .unwrap_or_else(|| unreachable!("a segment was pushed"));
            if anchored && start == 0 && current.start == 0 && self.cuts {
                current.lead = Some((self.id[pattern], end - start));
            } else if anchored && start > 0 && self.cuts {
                current.end = start;
                out.push(Segment {
                    start,
                    end: text.len(),
                    lead: Some((self.id[pattern], end - start)),
                    plain: true,
                });
            } else {
                // An occurrence inside the segment, other than its lead.
                let lead_end = current.start + current.lead.map_or(0, |(_, len)| len);
                if start >= lead_end {
                    current.plain = false;
                }
            }
            while i < found.len() && found[i].0 == start {
                reach = reach.max(found[i].1);
                i += 1;
            }
        }
        debug_assert!(out[first..].windows(2).all(|w| w[0].end == w[1].start));
    }

    /// The cut points of `text` (segment starts other than 0).
    #[cfg(test)]
    pub(crate) fn cut_points(&self, text: &str, out: &mut Vec<usize>) {
        let mut segments = Vec::new();
        self.segments(text, &mut segments);
        out.extend(segments.iter().skip(1).map(|s| s.start));
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
        && first.is_some_and(|c| {
            c.is_ascii() && !c.is_ascii_whitespace() && !c.is_ascii_alphanumeric() && c != '_'
        })
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
    fn segments_know_their_lead_and_whether_they_are_plain() {
        let tok = tokenizer(vec![
            AddedToken::from("<a>", true),
            AddedToken::from("<l>", true).lstrip(true),
        ]);
        let seg = Segmenter::new(&tok);
        let a = tok.token_to_id("<a>").unwrap();
        let mut out = Vec::new();
        seg.segments("<a>x<a>y <l>z<a>", &mut out);
        assert_eq!(
            out,
            vec![
                Segment {
                    start: 0,
                    end: 4,
                    lead: Some((a, 3)),
                    plain: true
                },
                Segment {
                    start: 4,
                    end: 13,
                    lead: Some((a, 3)),
                    plain: false
                },
                Segment {
                    start: 13,
                    end: 16,
                    lead: Some((a, 3)),
                    plain: true
                },
            ]
        );
        out.clear();
        seg.segments("x<", &mut out);
        assert_eq!(
            out,
            vec![Segment {
                start: 0,
                end: 2,
                lead: None,
                plain: true
            }]
        );
        out.clear();
        seg.segments("", &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn no_cuts_without_anchors() {
        let seg = Segmenter::new(&tokenizer(vec![AddedToken::from(" x", true)]));
        assert!(!seg.can_cut());
        assert_eq!(cuts(&seg, "a x b"), Vec::<usize>::new());
    }
}
