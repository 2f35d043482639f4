//! Requests seen before: their token count and block keys, so a request
//! whose prompt the router has prepared already skips tokenization (local
//! rendering and encoding, or the engine's `/tokenize` round trip) and key
//! computation.
//!
//! Retries by clients, the same prompt sent by many clients (evaluation and
//! benchmark harnesses, agents repeating a tool call), `n` samples sent as
//! separate requests: all reach the router with the same id-relevant fields.
//!
//! **Identity.** An entry is keyed by a 128-bit XXH3 digest of everything
//! the keys depend on: the endpoint kind, the engines' model name, the
//! tokenization mode in effect, the block width, the LoRA name, the cache
//! salt, and each id-relevant field's name and raw JSON bytes as sent. A
//! collision (about 2⁻⁶⁴ at four billion entries) would route a request on
//! another prompt's keys: it can cost a cache hit, never change what an
//! engine computes.
//!
//! **Bounds.** At most `capacity_bytes` of keys (16 bytes per block plus a
//! fixed overhead per entry) over a few shards, each a short mutex over a
//! map and its insertion order; the oldest entries go first. Each worker
//! set's runtime has its own memo, so a changed tokenizer or block width
//! (a new runtime) starts empty.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kinference_kvindex::BlockKey;
use kinference_scoring::Request;
use parking_lot::Mutex;
use xxhash_rust::xxh3::Xxh3;

use crate::openai::{self, Fields};
use crate::tokens::Source;

/// Fixed per-entry charge against the budget (map slot, order slot, Arcs).
const ENTRY_OVERHEAD: usize = 96;

const SHARDS: usize = 8;

/// What a prepared route keeps of its prompt.
#[derive(Clone, Debug)]
pub struct Memo {
    /// How the ids were obtained.
    pub tokens: Source,
    /// What the policy reads about the request.
    pub request: Request,
    /// The prompt's block keys (what the prefix record stores).
    pub keys: Arc<[u64]>,
    /// The same keys for the index.
    pub block_keys: Arc<[BlockKey]>,
}

impl Memo {
    fn charge(&self) -> usize {
        ENTRY_OVERHEAD + self.keys.len() * 16
    }
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<u128, Memo>,
    order: VecDeque<u128>,
    bytes: usize,
}

/// A bounded memo of prepared routes.
#[derive(Debug)]
pub struct RouteMemo {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
}

impl RouteMemo {
    /// A memo of at most `capacity_bytes` (0 disables it).
    pub fn new(capacity_bytes: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: capacity_bytes / SHARDS,
        }
    }

    fn shard(&self, key: u128) -> &Mutex<Shard> {
        &self.shards[(key as usize) % SHARDS]
    }

    /// The entry for `key`.
    pub fn get(&self, key: u128) -> Option<Memo> {
        if self.shard_budget == 0 {
            return None;
        }
        self.shard(key).lock().map.get(&key).cloned()
    }

    /// Keeps `memo` under `key`, dropping the oldest entries over budget.
    /// An entry larger than a quarter of a shard is not kept.
    pub fn insert(&self, key: u128, memo: Memo) {
        let charge = memo.charge();
        if charge > self.shard_budget / 4 {
            return;
        }
        let mut s = self.shard(key).lock();
        if let Some(old) = s.map.insert(key, memo) {
            s.bytes -= old.charge();
        } else {
            s.order.push_back(key);
        }
        s.bytes += charge;
        while s.bytes > self.shard_budget {
            let Some(oldest) = s.order.pop_front() else {
                break;
            };
            if let Some(gone) = s.map.remove(&oldest) {
                s.bytes -= gone.charge();
            }
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a route's keys depend on, besides the request's fields.
#[derive(Clone, Copy, Debug)]
pub struct KeyScope<'a> {
    /// The engines' model name.
    pub model: &'a str,
    /// The tokenization mode in effect.
    pub mode: &'a str,
    /// The block width.
    pub block_size: u32,
    /// The LoRA adapter, if the model is one.
    pub lora: Option<&'a str>,
}

/// The memo key of `fields` sent to `api` under `scope`.
pub fn key(api: openai::Endpoint, scope: KeyScope<'_>, fields: &Fields<'_>) -> u128 {
    let mut h = Xxh3::new();
    let mut put = |b: &[u8]| {
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(b);
    };
    put(api.path().as_bytes());
    put(scope.model.as_bytes());
    put(scope.mode.as_bytes());
    put(&scope.block_size.to_le_bytes());
    put(scope.lora.unwrap_or("\0").as_bytes());
    put(fields.cache_salt.as_deref().unwrap_or("\0").as_bytes());
    for (name, raw) in &fields.id_fields {
        put(name.as_bytes());
        put(raw.get().as_bytes());
    }
    h.digest128()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kinference_scoring::CacheSource;

    fn memo(blocks: usize) -> Memo {
        Memo {
            tokens: Source::Local,
            request: Request {
                prompt_tokens: 16 * blocks as u32,
                block_tokens: 16,
                cache: CacheSource::Index,
                ttft_target: None,
            },
            keys: (0..blocks as u64).collect(),
            block_keys: (0..blocks as u64).map(BlockKey).collect(),
        }
    }

    fn key_of(body: &[u8], scope: KeyScope<'_>) -> u128 {
        key(
            openai::Endpoint::Chat,
            scope,
            &openai::parse(openai::Endpoint::Chat, body).unwrap(),
        )
    }

    #[test]
    fn keys_follow_what_the_ids_depend_on_and_nothing_else() {
        let scope = KeyScope {
            model: "m",
            mode: "local",
            block_size: 16,
            lora: None,
        };
        let a =
            br#"{"model":"alias","messages":[{"role":"user","content":"hi"}],"temperature":0.1}"#;
        let same = br#"{"temperature":0.9,"stream":true,"model":"other","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            key_of(a, scope),
            key_of(same, scope),
            "sampling fields do not matter"
        );
        let other = br#"{"model":"m","messages":[{"role":"user","content":"ho"}]}"#;
        assert_ne!(key_of(a, scope), key_of(other, scope));
        let tools = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[]}"#;
        assert_ne!(key_of(a, scope), key_of(tools, scope));
        for changed in [
            KeyScope {
                block_size: 32,
                ..scope
            },
            KeyScope {
                mode: "engine",
                ..scope
            },
            KeyScope {
                lora: Some("sql"),
                ..scope
            },
            KeyScope {
                model: "n",
                ..scope
            },
        ] {
            assert_ne!(key_of(a, scope), key_of(a, changed), "{changed:?}");
        }
    }

    #[test]
    fn the_memo_is_bounded_and_drops_the_oldest() {
        let m = RouteMemo::new(SHARDS * 4 * (ENTRY_OVERHEAD + 16 * 10));
        for k in 0..(SHARDS as u128 * 10) {
            m.insert(k, memo(10));
        }
        assert!(m.len() <= SHARDS * 4, "{}", m.len());
        assert!(m.get(0).is_none(), "the oldest went first");
        let last = SHARDS as u128 * 10 - 1;
        assert_eq!(m.get(last).unwrap().keys.len(), 10);
        m.insert(1 << 90, memo(100_000));
        assert!(m.get(1 << 90).is_none(), "too large to keep");
        let off = RouteMemo::new(0);
        off.insert(1, memo(1));
        assert!(off.get(1).is_none());
    }
}
