//! Applying `BlockStored`: checking and decoding the event (locality,
//! KV-cache group and its kind, tier, width and re-chunking, extra keys),
//! recording the worker's groups, [`KvIndex::store_hashed`] (the path after
//! decoding), and placeholder stores (no tokens: a tier update). The walk
//! that stores a chain of keys is in `write`.

// w, g, h, k, n, s: worker, group, hash, keys per block, count, event (as
// in `write`).
#![allow(clippy::many_single_char_names)]

use smallvec::SmallVec;

use super::StoreSpec;
use crate::event::{BlockHash, BlockStored, Tier};
use crate::index::groups::{self, Group, Rule, RuleKind};
use crate::index::{Applied, IndexError, KvIndex, WorkerId, Writer, lock, sessions, write};
use crate::key;

impl KvIndex {
    pub(super) fn apply_stored(&self, wr: &mut Writer, w: usize, s: &BlockStored) -> Applied {
        let n = s.block_hashes.len() as u64;
        let group = s.group_idx.unwrap_or(0);
        let ws = wr.workers[w].as_mut().expect("checked");
        if s.block_size > 0
            && !ws.stats.observed_widths.contains(&(group, s.block_size))
            && ws.stats.observed_widths.len() < 16
        {
            ws.stats.observed_widths.push((group, s.block_size));
        }
        let dropped = Applied {
            dropped: n,
            ..Applied::default()
        };
        if s.locality.as_deref() == Some("REMOTE") {
            ws.stats.remote_blocks += n;
            return dropped;
        }
        let (Some(kind), Ok(g)) = (
            groups::kind_rule(s.kv_cache_spec_kind.as_deref()),
            u16::try_from(group),
        ) else {
            ws.stats.other_group_blocks += n;
            return dropped;
        };
        let tier = Tier::from_medium(s.medium.as_deref());
        let hashes: SmallVec<[u64; 64]> = s.block_hashes.iter().map(BlockHash::id).collect();
        if s.token_ids.is_empty() {
            return self.placeholder(wr, w, g, &hashes, tier);
        }
        if n == 0 {
            // vLLM's Mamba groups report prefill tokens without a state.
            return Applied::default();
        }
        let width = ws.width;
        let bs = s.block_size;
        if bs == 0 || !bs.is_multiple_of(width) || s.token_ids.len() as u64 != u64::from(bs) * n {
            ws.stats.width_mismatch_blocks += n;
            return dropped;
        }
        let k = (bs / width) as usize;
        if k > 1 {
            ws.stats.rechunked_blocks += n;
        }
        let state_only =
            self.observe_group(wr, w, g, kind, k as u32, s.kv_cache_spec_sliding_window);
        // Most events carry no extra keys (vLLM sends a list of nils).
        let plain = s.cache_salt.is_none()
            && s.extra_keys
                .as_ref()
                .is_none_or(|l| l.iter().all(Option::is_none));
        let extras = if plain {
            Vec::new()
        } else {
            key::event_extra_digests(s)
        };
        let mut locals = std::mem::take(&mut wr.keys);
        locals.clear();
        // Per engine block, its k keys (no division per key: a division
        // costs more than the rest of the loop).
        for (b, block) in s.token_ids.chunks_exact(bs as usize).enumerate() {
            let extra = extras.get(b).copied().unwrap_or(0);
            for chunk in block.chunks_exact(width as usize) {
                locals.push(key::local_hash(chunk, extra));
            }
        }
        let parent = s.parent_block_hash.as_ref().map(BlockHash::id);
        let spec = StoreSpec {
            group: g,
            tier,
            state_only,
        };
        let out = self.store_locked(
            wr,
            w,
            parent,
            key::seed_for_event(s),
            &hashes,
            &locals,
            k,
            spec,
        );
        wr.keys = locals;
        // Sessions: one group's stores tell the depth (every group of a
        // hybrid model stores the same tokens); orphans tell nothing.
        if let Some(sid) = s.session_id.as_deref()
            && g == 0
            && out.dropped == 0
        {
            write(&self.sessions).stored(
                sessions::session_key(sid),
                WorkerId(w as u32),
                s.token_ids.len() as u64,
                parent.is_none(),
            );
        }
        out
    }

    /// Records group `g` of worker `w` as seen with `k` keys per block;
    /// returns whether it is a state group.
    fn observe_group(
        &self,
        wr: &mut Writer,
        w: usize,
        g: u16,
        kind: RuleKind,
        k: u32,
        window: Option<u32>,
    ) -> bool {
        let ws = wr.workers[w].as_mut().expect("checked");
        let changed = match ws.groups.binary_search_by_key(&g, |x| x.idx) {
            Ok(i) => {
                let before = ws.groups[i];
                ws.groups[i].observe(k, window);
                ws.groups[i] != before
            }
            Err(i) => {
                ws.groups
                    .insert(i, Group::new(g, kind, k, window, ws.width));
                ws.stats.groups = ws.groups.iter().map(|x| u32::from(x.idx)).collect();
                true
            }
        };
        let state = ws
            .groups
            .iter()
            .find(|x| x.idx == g)
            .is_some_and(|x| x.rule == Rule::State);
        if changed {
            self.publish_groups(wr, w);
        }
        state
    }

    /// Stores blocks for a worker from already-computed content hashes:
    /// `locals[i]` is [`key::local_hash`] of block i's tokens (what the
    /// index computes from `token_ids`), `hashes[i]` the engine's id of
    /// block i, `parent` the engine id of the block before the first
    /// (`None`: the chain starts here, from `seed`, see
    /// [`key::seed_for_lora`]), in KV-cache group 0. This is the path
    /// events take after decoding and hashing; benchmarks and tests call
    /// it directly.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn store_hashed(
        &self,
        id: WorkerId,
        parent: Option<u64>,
        seed: u64,
        hashes: &[u64],
        locals: &[u64],
        tier: Tier,
    ) -> Result<Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        let w = id.0 as usize;
        let n = hashes.len().min(locals.len());
        let state_only = self.observe_group(&mut wr, w, 0, RuleKind::Full, 1, None);
        let spec = StoreSpec {
            group: 0,
            tier,
            state_only,
        };
        Ok(self.store_locked(
            &mut wr,
            w,
            parent,
            seed,
            &hashes[..n],
            &locals[..n],
            1,
            spec,
        ))
    }

    /// A placeholder store (no tokens): tier `tier` for the blocks of
    /// `hashes` that worker `w` holds in group `g`.
    fn placeholder(
        &self,
        wr: &mut Writer,
        w: usize,
        g: u16,
        hashes: &[u64],
        tier: Tier,
    ) -> Applied {
        let mut unknown = 0u64;
        for &h in hashes {
            let mut any = false;
            for (nid, a, b) in self.block_ranges(wr, w, g, h) {
                let mut sh = write(&self.shards[self.node_shard(nid)].0);
                let node = sh.node_mut(self.node_slot(nid)).expect("live node");
                if let Ok(i) = node.hot.holder_index(w as u32, g) {
                    any |= node.hot.holders[i]
                        .runs
                        .add_tier_where_held(a, b, tier.bit());
                }
            }
            unknown += u64::from(!any);
        }
        let ws = wr.workers[w].as_mut().expect("checked");
        ws.stats.unknown_placeholders += unknown;
        Applied::default()
    }
}
