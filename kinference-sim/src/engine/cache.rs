//! The engine core's prefix cache over its block pool: prefix lookups (at
//! admission and for callers), vLLM's `allocate_slots` (allocation with LRU
//! eviction, caching the blocks a step fills), the reset, and the
//! `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events they queue.

use super::{CoreStats, EngineCore, Req, ReqId, SimEvent};
use crate::hash::Digest;
use crate::pool::BlockId;

impl EngineCore {
    /// vLLM's `reset_prefix_cache`: succeeds only when no request holds a
    /// block; then queues `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.pool.reset() {
            return false;
        }
        self.events.push(SimEvent::Cleared);
        self.stats.cache_resets += 1;
        true
    }

    /// Prompt tokens of `tokens` that a base-model request would find
    /// cached now (whole blocks, at most `len - 1` tokens, as at admission).
    pub fn cached_prefix_tokens(&self, tokens: &[u32]) -> usize {
        self.cached_prefix_tokens_for(tokens, None)
    }

    /// [`EngineCore::cached_prefix_tokens`] for a request of adapter `lora`
    /// (`None`: the base model; an adapter the core does not serve: 0).
    pub fn cached_prefix_tokens_for(&self, tokens: &[u32], lora: Option<u32>) -> usize {
        if !self.cfg.enable_prefix_caching || tokens.is_empty() {
            return 0;
        }
        let extra = self.loras.extra(lora);
        if lora.is_some() && extra.is_none() {
            return 0;
        }
        let max_blocks = (tokens.len() - 1) / self.cfg.block_size;
        let mut parent: Option<Digest> = None;
        let mut n = 0;
        for block in tokens.chunks_exact(self.cfg.block_size).take(max_blocks) {
            let d = self.hasher.hash_block_with(parent.as_ref(), block, extra);
            if self.pool.lookup(&d).is_none() {
                break;
            }
            parent = Some(d);
            n += 1;
        }
        n * self.cfg.block_size
    }

    /// vLLM's `emit_cached_block_events`: a `kv_cache_report_mode: "full"`
    /// request re-announces the `hits` blocks its prefix-cache lookup found,
    /// as one `BlockStored` from the start of the sequence (parent nil),
    /// without changing any block.
    pub(super) fn rereport_hits(&mut self, id: ReqId, hits: usize) {
        let r = &self.reqs[&id];
        if !r.report_full || hits == 0 {
            return;
        }
        let bs = self.cfg.block_size;
        self.events.push(SimEvent::Stored {
            digests: r.digests[..hits].to_vec(),
            parent: None,
            tokens: r.tokens[..hits * bs].to_vec(),
            lora: r.lora,
            session: r.session.clone(),
        });
        self.stats.blocks_rereported += hits as u64;
    }

    /// Finds the cached prefix of a waiting request: the blocks and the
    /// number of tokens they hold.
    pub(super) fn lookup_prefix(&mut self, id: ReqId) -> (Vec<BlockId>, usize) {
        if !self.cfg.enable_prefix_caching {
            return (Vec::new(), 0);
        }
        let bs = self.cfg.block_size;
        let r = self.reqs.get_mut(&id).expect("waiting request exists");
        let extra = self.loras.extra(r.lora);
        self.hasher.extend_with(&r.tokens, &mut r.digests, extra);
        let max_blocks = (r.tokens.len() - 1) / bs;
        let mut hits = Vec::new();
        for d in r.digests.iter().take(max_blocks) {
            match self.pool.lookup(d) {
                Some(b) => hits.push(b),
                None => break,
            }
        }
        let n = hits.len() * bs;
        (hits, n)
    }

    /// vLLM's `allocate_slots`: blocks for `num_new` more tokens after
    /// `num_computed` (which includes the `hits`), then caches the blocks
    /// those tokens fill. False (and nothing changed) if blocks run out.
    pub(super) fn allocate(&mut self, id: ReqId, num_new: usize, hits: &[BlockId]) -> bool {
        let bs = self.cfg.block_size;
        let EngineCore {
            reqs,
            pool,
            hasher,
            events,
            stats,
            cfg,
            loras,
            ..
        } = self;
        let set_semantics = self.set_semantics;
        let r = reqs.get_mut(&id).expect("scheduled request exists");
        let total = r.num_computed + num_new;
        let need = total.div_ceil(bs);
        let have = r.blocks.len() + hits.len();
        let new_blocks = need.saturating_sub(have);
        let evictable_hits = hits.iter().filter(|b| pool.ref_cnt(**b) == 0).count();
        if new_blocks + evictable_hits > pool.num_free() {
            return false;
        }
        for &b in hits {
            pool.touch(b);
            r.blocks.push(b);
        }
        if !hits.is_empty() {
            r.num_cached_blocks = r.blocks.len();
        }
        for _ in 0..new_blocks {
            let (b, evicted) = pool.allocate().expect("free blocks were counted");
            if let Some((digest, parent)) = evicted
                && !(set_semantics && pool.lookup(&digest).is_some())
            {
                events.push(SimEvent::Removed { digest, parent });
                stats.blocks_removed += 1;
            }
            r.blocks.push(b);
        }
        if cfg.enable_prefix_caching {
            let full = total.min(r.tokens.len()) / bs;
            if full > r.num_cached_blocks {
                let from = r.num_cached_blocks;
                hasher.extend_with(&r.tokens[..full * bs], &mut r.digests, loras.extra(r.lora));
                // One event per run of newly cached blocks; under set
                // semantics a digest already cached elsewhere is not
                // announced again (it splits the run).
                let mut run = from;
                for i in from..full {
                    let p = i.checked_sub(1).map(|p| r.digests[p]);
                    let known = set_semantics && pool.lookup(&r.digests[i]).is_some();
                    pool.cache(
                        r.blocks[i],
                        r.digests[i],
                        p,
                        &r.tokens[i * bs..(i + 1) * bs],
                        r.lora,
                    );
                    if known {
                        push_stored(events, stats, r, run, i, bs);
                        run = i + 1;
                    }
                }
                push_stored(events, stats, r, run, full, bs);
                r.num_cached_blocks = full;
            }
        }
        true
    }
}

/// Announces the request's blocks `from..to` (if any) as one `BlockStored`.
fn push_stored(
    events: &mut Vec<SimEvent>,
    stats: &mut CoreStats,
    r: &Req,
    from: usize,
    to: usize,
    bs: usize,
) {
    if to <= from {
        return;
    }
    events.push(SimEvent::Stored {
        digests: r.digests[from..to].to_vec(),
        parent: from.checked_sub(1).map(|p| r.digests[p]),
        tokens: r.tokens[from * bs..to * bs].to_vec(),
        lora: r.lora,
        session: r.session.clone(),
    });
    stats.blocks_stored += (to - from) as u64;
}
