//! KV-cache groups of hybrid models and the rule that turns what each group
//! holds into a usable prefix.
//!
//! Hybrid models (sliding-window or Mamba layers beside full attention:
//! Gemma 3/4, Qwen3-Next/3.5, DeepSeek-V4) keep one KV-cache group per
//! layer kind, each with its own block size, and publish events per group
//! (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`,
//! `block_size`). The engine can reuse a prefix of L tokens only if every
//! group can (vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`):
//!
//! * **full attention** (also MLA, sink, unknown kinds): every block of
//!   `[0, L)` is cached;
//! * **sliding window** of W tokens, blocks of b tokens: the
//!   `ceil((W - 1) / b)` blocks before L are cached (or all of `[0, L)`
//!   when L is that short), so the front of a long prompt may be gone;
//! * **Mamba / state** groups: the state at L is cached, i.e. a stored
//!   block ends exactly at L (the index keeps only the last position of
//!   each stored state block);
//!
//! and L is a multiple of each attention group's block width (the
//! narrowest width its events used, so vLLM 0.33's partial blocks count).
//! Positions here are block keys at the worker's width (the router's
//! `kvBlockSize`, the engine's hash block size).

/// How one group decides which prefix lengths it can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    /// Every position of the prefix.
    Full,
    /// The last `need` positions before the end (all of them when the
    /// prefix is shorter).
    Window { need: u32 },
    /// A held position right before the end.
    State,
}

/// One KV-cache group of a worker, as learned from its events (or set by
/// [`crate::KvIndex::set_worker_groups`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) idx: u16,
    pub(crate) kind: RuleKind,
    pub(crate) rule: Rule,
    /// Keys per regular block of this group (its widest event block).
    pub(crate) width: u32,
    /// Keys per block of its narrowest event block: a prefix must end on a
    /// multiple of it (1 once partial blocks were seen).
    pub(crate) align: u32,
    /// Sliding window in tokens, when the events said.
    pub(crate) window_tokens: Option<u32>,
    /// Tokens per key (the worker's width).
    pub(crate) key_tokens: u32,
}

/// What a group's kind means, from `kv_cache_spec_kind`; `None` for kinds
/// that are not prefix-cached (their events are ignored).
pub(crate) fn kind_rule(kind: Option<&str>) -> Option<RuleKind> {
    Some(match kind {
        Some("sliding_window" | "sliding_window_mla") => RuleKind::Window,
        Some("mamba") => RuleKind::State,
        Some("encoder_only_attention" | "cross_attention") => return None,
        // full_attention, mla_attention, sink_full_attention,
        // chunked_local_attention (conservatively), unknown, absent.
        _ => RuleKind::Full,
    })
}

/// A group's kind, before block widths are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RuleKind {
    Full,
    Window,
    State,
}

impl Group {
    /// A group as one event describes it: `width` keys per event block of
    /// `key_tokens` tokens each.
    pub(crate) fn new(
        idx: u16,
        kind: RuleKind,
        width: u32,
        window_tokens: Option<u32>,
        key_tokens: u32,
    ) -> Self {
        let mut g = Group {
            idx,
            kind,
            rule: Rule::Full,
            width: width.max(1),
            align: width.max(1),
            window_tokens,
            key_tokens: key_tokens.max(1),
        };
        g.set_rule();
        g
    }

    fn set_rule(&mut self) {
        self.rule = match (self.kind, self.window_tokens) {
            (RuleKind::State, _) => Rule::State,
            // Without its window a sliding-window group is treated as full
            // attention: it never claims more than the engine holds.
            (RuleKind::Window, None) | (RuleKind::Full, _) => Rule::Full,
            (RuleKind::Window, Some(w)) => {
                // ceil((W - 1) / b) blocks of b = width * key_tokens tokens.
                let block_tokens = self.width * self.key_tokens;
                let blocks = w.saturating_sub(1).div_ceil(block_tokens);
                Rule::Window {
                    need: blocks.max(1) * self.width,
                }
            }
        };
    }

    /// Folds in another event of this group (`width` keys per block): a
    /// narrower block lowers the alignment, a wider one raises the width.
    pub(crate) fn observe(&mut self, width: u32, window_tokens: Option<u32>) {
        let width = width.max(1);
        self.align = self.align.min(width);
        let mut changed = false;
        if width > self.width {
            self.width = width;
            changed = true;
        }
        if window_tokens.is_some() && window_tokens != self.window_tokens {
            self.window_tokens = window_tokens;
            changed = true;
        }
        if changed {
            self.set_rule();
        }
    }
}

/// Held intervals `[start, end)` of positions along a query path.
pub(crate) type Intervals = smallvec::SmallVec<[(u32, u32); 4]>;

/// The longest usable prefix (in positions, at most `limit`) for a worker
/// whose groups hold `held[i]` (sorted, disjoint intervals) per
/// `groups[i]`.
pub(crate) fn usable_prefix(groups: &[Group], held: &[Intervals], limit: u32) -> u32 {
    // Each group's accepted prefix lengths as closed intervals [lo, hi].
    let mut acc: Intervals = smallvec::smallvec![(0, limit)];
    let mut align = 1u32;
    for (g, h) in groups.iter().zip(held) {
        let mut ok: Intervals = Intervals::new();
        ok.push((0, 0));
        for &(s, e) in h {
            let e = e.min(limit);
            if s >= e {
                continue;
            }
            let lo = match g.rule {
                Rule::Full | Rule::Window { .. } if s == 0 => 0,
                Rule::Full => continue,
                Rule::Window { need } => s + need,
                Rule::State => s + 1,
            };
            if lo <= e {
                ok.push((lo, e));
            }
            if g.rule == Rule::Full {
                break;
            }
        }
        if g.rule != Rule::State {
            align = lcm(align, g.align.max(1));
        }
        acc = intersect(&acc, &ok);
        if acc.len() == 1 && acc[0] == (0, 0) {
            return 0;
        }
    }
    // The largest aligned length inside an accepted interval.
    for &(lo, hi) in acc.iter().rev() {
        let l = hi / align * align;
        if l >= lo {
            return l;
        }
    }
    0
}

/// Intersection of two sorted lists of closed intervals.
fn intersect(a: &Intervals, b: &Intervals) -> Intervals {
    let mut b_sorted = b.clone();
    b_sorted.sort_unstable();
    let mut out = Intervals::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b_sorted.len() {
        let lo = a[i].0.max(b_sorted[j].0);
        let hi = a[i].1.min(b_sorted[j].1);
        if lo <= hi {
            if let Some(last) = out.last_mut()
                && last.1 + 1 >= lo
            {
                last.1 = last.1.max(hi);
            } else {
                out.push((lo, hi));
            }
        }
        if a[i].1 < b_sorted[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u32, b: u32) -> u32 {
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(v: &[(u32, u32)]) -> Intervals {
        v.iter().copied().collect()
    }

    #[test]
    fn full_attention_alone_is_the_leading_run() {
        let g = [Group::new(0, RuleKind::Full, 1, None, 16)];
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 7), (9, 12)])], 20), 7);
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 7)])], 5), 5);
        assert_eq!(usable_prefix(&g, &[iv(&[(2, 7)])], 20), 0);
    }

    #[test]
    fn a_sliding_window_needs_only_the_blocks_before_the_end() {
        // Full attention holds 0..12; the window group (2 keys of 16
        // tokens per block, a 64-token window: ceil(63/32) = 2 blocks = 4
        // keys) lost its front.
        let g = [
            Group::new(0, RuleKind::Full, 1, None, 16),
            Group::new(1, RuleKind::Window, 2, Some(64), 16),
        ];
        assert_eq!(g[1].rule, Rule::Window { need: 4 });
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 12)]), iv(&[(6, 12)])], 12), 12);
        // Its tail gone too: the last 4 keys before L must be held.
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 12)]), iv(&[(2, 8)])], 12), 8);
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 12)]), iv(&[(4, 7)])], 12), 0);
        // A short prefix held from 0 is enough.
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 12)]), iv(&[(0, 3)])], 12), 2);
        // Full attention bounds it.
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 9)]), iv(&[(2, 12)])], 12), 8);
    }

    #[test]
    fn a_state_group_needs_a_state_at_the_end() {
        let g = [
            Group::new(0, RuleKind::Full, 4, None, 16),
            Group::new(1, RuleKind::State, 4, None, 16),
        ];
        // States after 4 and 12 (positions 3 and 11); full attention to 14.
        assert_eq!(
            usable_prefix(&g, &[iv(&[(0, 14)]), iv(&[(3, 4), (11, 12)])], 16),
            12
        );
        assert_eq!(
            usable_prefix(&g, &[iv(&[(0, 10)]), iv(&[(3, 4), (11, 12)])], 16),
            4
        );
        assert_eq!(usable_prefix(&g, &[iv(&[(0, 10)]), iv(&[])], 16), 0);
    }

    #[test]
    fn partial_blocks_lower_the_alignment() {
        let mut g = Group::new(0, RuleKind::Full, 4, None, 16);
        assert_eq!(usable_prefix(&[g], &[iv(&[(0, 7)])], 16), 4);
        g.observe(1, None);
        assert_eq!(usable_prefix(&[g], &[iv(&[(0, 7)])], 16), 7);
    }
}
