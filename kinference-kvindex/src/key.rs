//! Block keys: our own chained 64-bit hash per full block of tokens.
//!
//! ```text
//! seed       = S(lora name)                      (base model: a constant)
//! local_i    = XXH3-64(tokens of block i as little-endian u32, seed = E_i)
//! key_i      = XXH3-64(key_{i-1} ‖ local_i as little-endian u64)   with key_{-1} = seed
//! ```
//!
//! `E_i` is the digest of block i's extra keys ([`ExtraItem`]: multimodal
//! items overlapping the block, the cache salt on block 0, prompt-embedding
//! digests), 0 when there are none. A key therefore names the whole prefix
//! up to and including its block (content, LoRA adapter and extras): two
//! requests share key_i exactly when they share blocks 0..=i. A trailing
//! partial block has no key.
//!
//! The same function keys a request's token ids ([`BlockKeyer::keys`]) and
//! the token ids carried by `BlockStored` events (the index calls
//! [`chain`] with [`local_hash`]), so they meet in the index.
//! The hash is XXH3 from `xxhash-rust`: stable across versions, platforms
//! and processes (unlike foldhash/ahash), so keys may be shared or logged.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::event::{BlockStored, Value};

/// Our key of one full block (and, through the chain, of its whole prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

const SEED_BASE: u64 = 0x6b69_6e66_6572_656e; // "kinferen"
const SEED_LORA: u64 = 0x6c6f_7261_6e61_6d65; // "loraname"
const SEED_LORA_ID: u64 = 0x6c6f_7261_5f69_6400; // "lora_id\0"
const SEED_CHAIN: u64 = 0x6368_6169_6e6b_6579; // "chainkey"
const SEED_EXTRA: u64 = 0x6578_7472_616b_6579; // "extrakey"

/// The chain seed (`key_{-1}`) for a LoRA adapter name; `None` is the base
/// model.
pub fn seed_for_lora(lora_name: Option<&str>) -> u64 {
    match lora_name {
        None => SEED_BASE,
        Some(name) => xxh3_64_with_seed(name.as_bytes(), SEED_LORA),
    }
}

/// The seed for an event that names its adapter only by integer id (vLLM
/// before 0.14). Such blocks get their own namespace: they never match a
/// base-model request, and never match a request by adapter name either.
pub fn seed_for_lora_id(lora_id: i64) -> u64 {
    xxh3_64_with_seed(&lora_id.to_le_bytes(), SEED_LORA_ID)
}

/// The seed an event's blocks chain from: its `lora_name`, else its
/// `lora_id`, else the base model.
pub fn seed_for_event(ev: &BlockStored) -> u64 {
    match (&ev.lora_name, ev.lora_id) {
        (Some(name), _) => seed_for_lora(Some(name)),
        (None, Some(id)) => seed_for_lora_id(id),
        (None, None) => seed_for_lora(None),
    }
}

/// The content hash of one block's tokens with its extra-key digest.
pub fn local_hash(tokens: &[u32], extra_digest: u64) -> u64 {
    // 16-token blocks (vLLM's default width) at a fixed length: the copy
    // and the hash's length dispatch compile down to straight-line code.
    if let Ok(block) = <&[u32; 16]>::try_from(tokens) {
        let mut buf = [0u8; 64];
        for (chunk, t) in buf.chunks_exact_mut(4).zip(block) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&buf, extra_digest);
    }
    if tokens.len() <= 16 {
        let mut buf = [0u8; 64];
        let n = tokens.len() * 4;
        for (chunk, t) in buf[..n].chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&buf[..n], extra_digest);
    }
    let mut buf = [0u8; 256];
    if tokens.len() <= 64 {
        let n = tokens.len() * 4;
        for (chunk, t) in buf[..n].chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..n], extra_digest)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, extra_digest)
    }
}

/// `key_i` from `key_{i-1}` (or the seed) and `local_i`.
#[inline]
pub fn chain(prev: u64, local: u64) -> BlockKey {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&prev.to_le_bytes());
    b[8..].copy_from_slice(&local.to_le_bytes());
    BlockKey(xxh3_64_with_seed(&b, SEED_CHAIN))
}

/// One extra hash input of a block, in vLLM's order: multimodal items,
/// then the cache salt (first block only), then prompt-embedding digests.
/// The LoRA adapter is not an item: it is the chain seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraItem {
    /// A multimodal item overlapping the block: its identifier and the
    /// offset of its first placeholder token from the block start
    /// (negative when it began in an earlier block).
    Multimodal {
        /// The engine's item identifier (vLLM's `mm_hash`/identifier).
        id: String,
        /// Offset from the block's first token.
        offset: i64,
    },
    /// A string: the cache salt (or, in vLLM 0.17–0.18, a bare mm id).
    Str(String),
    /// Raw bytes (a prompt-embeddings digest).
    Bytes(Vec<u8>),
    /// Any other published value, kept so it still separates keys.
    Other(String),
}

/// The digest `E_i` of one block's extra items (0 for none).
pub fn extra_digest(items: &[ExtraItem]) -> u64 {
    if items.is_empty() {
        return 0;
    }
    let mut buf = Vec::with_capacity(64);
    for it in items {
        match it {
            ExtraItem::Multimodal { id, offset } => {
                buf.push(1);
                buf.extend_from_slice(&(id.len() as u64).to_le_bytes());
                buf.extend_from_slice(id.as_bytes());
                buf.extend_from_slice(&offset.to_le_bytes());
            }
            ExtraItem::Str(s) | ExtraItem::Other(s) => {
                buf.push(if matches!(it, ExtraItem::Str(_)) {
                    2
                } else {
                    4
                });
                buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
                buf.extend_from_slice(s.as_bytes());
            }
            ExtraItem::Bytes(b) => {
                buf.push(3);
                buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
                buf.extend_from_slice(b);
            }
        }
    }
    // Never 0, so "no extras" and "extras" cannot meet.
    xxh3_64_with_seed(&buf, SEED_EXTRA) | 1
}

/// Extra keys of a request, positioned in tokens: what the router knows
/// about a prompt besides its token ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    multimodal: Vec<(String, usize, usize)>,
    cache_salt: Option<String>,
    per_block: Vec<(usize, ExtraItem)>,
}

impl ExtraKeys {
    /// No extra keys (plain text, no salt).
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.multimodal.is_empty() && self.cache_salt.is_none() && self.per_block.is_empty()
    }

    /// A multimodal item whose placeholder tokens start at token `start`
    /// and span `len` tokens; every block it overlaps gets an item.
    #[must_use]
    pub fn multimodal(mut self, id: impl Into<String>, start: usize, len: usize) -> Self {
        self.multimodal.push((id.into(), start, len));
        self
    }

    /// The request's cache salt (mixed into the first block only).
    #[must_use]
    pub fn cache_salt(mut self, salt: impl Into<String>) -> Self {
        self.cache_salt = Some(salt.into());
        self
    }

    /// An arbitrary item appended to block `block` (e.g. an embeddings
    /// digest).
    #[must_use]
    pub fn item(mut self, block: usize, item: ExtraItem) -> Self {
        self.per_block.push((block, item));
        self
    }

    /// The items of block `i` for a given block width, in vLLM's order.
    pub fn items_for_block(&self, i: usize, block_size: usize) -> Vec<ExtraItem> {
        let mut items = Vec::new();
        let start = i.saturating_mul(block_size);
        let end = start.saturating_add(block_size);
        for (id, s, len) in &self.multimodal {
            if *s < end && s.saturating_add(*len) > start {
                items.push(ExtraItem::Multimodal {
                    id: id.clone(),
                    offset: *s as i64 - start as i64,
                });
            }
        }
        if i == 0
            && let Some(salt) = &self.cache_salt
        {
            items.push(ExtraItem::Str(salt.clone()));
        }
        items.extend(
            self.per_block
                .iter()
                .filter(|(b, _)| *b == i)
                .map(|(_, it)| it.clone()),
        );
        items
    }

    /// The digest of block `i`'s items.
    pub fn digest_for_block(&self, i: usize, block_size: usize) -> u64 {
        if self.is_empty() {
            0
        } else {
            extra_digest(&self.items_for_block(i, block_size))
        }
    }
}

/// Turns one published `extra_keys` entry (vLLM ≥ 0.17) into items. The
/// LoRA name, which vLLM lists first when set, is dropped: it is the seed.
pub fn items_from_published(entry: &[Value], lora_name: Option<&str>) -> Vec<ExtraItem> {
    let mut out = Vec::with_capacity(entry.len());
    for (n, v) in entry.iter().enumerate() {
        match v {
            Value::Str(s) if n == 0 && lora_name == Some(s.as_str()) => {}
            Value::Str(s) => out.push(ExtraItem::Str(s.clone())),
            Value::Array(pair) => match pair.as_slice() {
                [Value::Str(id), off @ (Value::Int(_) | Value::Uint(_))] => {
                    let offset = match off {
                        Value::Int(i) => *i,
                        Value::Uint(u) => i64::try_from(*u).unwrap_or(i64::MAX),
                        _ => 0,
                    };
                    out.push(ExtraItem::Multimodal {
                        id: id.clone(),
                        offset,
                    });
                }
                _ => out.push(ExtraItem::Other(format!("{v:?}"))),
            },
            Value::Bin(b) => out.push(ExtraItem::Bytes(b.clone())),
            other => out.push(ExtraItem::Other(format!("{other:?}"))),
        }
    }
    out
}

/// The extra digest of each block of a `BlockStored` event: from vLLM's
/// published `extra_keys`, or from SGLang's `cache_salt` on the first
/// block of a sequence (nil parent).
pub fn event_extra_digests(ev: &BlockStored) -> Vec<u64> {
    let n = ev.block_hashes.len();
    let mut out = vec![0u64; n];
    if let Some(list) = &ev.extra_keys {
        for (d, entry) in out.iter_mut().zip(list) {
            if let Some(items) = entry {
                *d = extra_digest(&items_from_published(items, ev.lora_name.as_deref()));
            }
        }
    } else if let (Some(salt), None, Some(first)) =
        (&ev.cache_salt, &ev.parent_block_hash, out.first_mut())
    {
        *first = extra_digest(&[ExtraItem::Str(salt.clone())]);
    }
    out
}

/// Computes block keys at a fixed block width for one adapter.
///
/// ```
/// use kinference_kvindex::key::{BlockKeyer, ExtraKeys};
/// let keyer = BlockKeyer::new(16, None);
/// let tokens: Vec<u32> = (0..40).collect();
/// let keys = keyer.keys(&tokens, &ExtraKeys::none());
/// assert_eq!(keys.len(), 2); // the 8 trailing tokens form no block
/// assert_eq!(keys[0], keyer.keys(&tokens[..16], &ExtraKeys::none())[0]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockKeyer {
    block_size: usize,
    seed: u64,
}

impl BlockKeyer {
    /// A keyer for `block_size`-token blocks (the worker set's
    /// `kvBlockSize`) of the given LoRA adapter (`None`: base model).
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn new(block_size: u32, lora_name: Option<&str>) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockKeyer {
            block_size: block_size as usize,
            seed: seed_for_lora(lora_name),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size as u32
    }

    /// The chain seed (`key_{-1}`).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Keys of every full block of `tokens`.
    pub fn keys(&self, tokens: &[u32], extra: &ExtraKeys) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.keys_into(tokens, extra, &mut out);
        out
    }

    /// Like [`keys`](Self::keys), appending to `out` (no allocation when it
    /// has room).
    pub fn keys_into(&self, tokens: &[u32], extra: &ExtraKeys, out: &mut Vec<BlockKey>) {
        let mut prev = self.seed;
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            let k = chain(
                prev,
                local_hash(block, extra.digest_for_block(i, self.block_size)),
            );
            out.push(k);
            prev = k.0;
        }
    }
}

/// Keys of every full block of `tokens`: the one function for request
/// token ids (the index applies the same chain to `BlockStored` tokens).
pub fn block_keys(
    tokens: &[u32],
    block_size: u32,
    lora_name: Option<&str>,
    extra: &ExtraKeys,
) -> Vec<BlockKey> {
    BlockKeyer::new(block_size, lora_name).keys(tokens, extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every width hashes the tokens' little-endian bytes (the module's
    /// formula), the 16-token fast path included.
    #[test]
    fn local_hash_is_xxh3_of_the_le_bytes_at_every_width() {
        let tokens: Vec<u32> = (0..80u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> 7)
            .collect();
        for n in [0, 1, 15, 16, 17, 32, 64, 65, 80] {
            let bytes: Vec<u8> = tokens[..n].iter().flat_map(|t| t.to_le_bytes()).collect();
            for extra in [0, 0x1234_5678_9abc_def1] {
                assert_eq!(
                    local_hash(&tokens[..n], extra),
                    xxh3_64_with_seed(&bytes, extra),
                    "{n} tokens"
                );
            }
        }
    }

    #[test]
    fn keys_chain_over_the_prefix() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 999; // differs in block 1
        let ka = block_keys(&a, 16, None, &ExtraKeys::none());
        let kb = block_keys(&b, 16, None, &ExtraKeys::none());
        assert_eq!(ka.len(), 4);
        assert_eq!(ka[0], kb[0]);
        // Block 1 differs, and so does every later key although blocks 2-3 match.
        assert!(ka[1..].iter().zip(&kb[1..]).all(|(x, y)| x != y));
    }

    #[test]
    fn lora_salt_and_width_separate_keys() {
        let t: Vec<u32> = (0..32).collect();
        let base = block_keys(&t, 16, None, &ExtraKeys::none());
        let lora = block_keys(&t, 16, Some("sql-lora"), &ExtraKeys::none());
        let salted = block_keys(&t, 16, None, &ExtraKeys::none().cache_salt("tenant-a"));
        let wide = block_keys(&t, 32, None, &ExtraKeys::none());
        assert_ne!(base[0], lora[0]);
        assert_ne!(base[0], salted[0]);
        assert_ne!(base[1], wide[0]);
        assert!(block_keys(&t[..15], 16, None, &ExtraKeys::none()).is_empty());
    }

    #[test]
    fn multimodal_items_get_block_relative_offsets() {
        let e = ExtraKeys::none().multimodal("img", 4, 20).cache_salt("s");
        assert_eq!(
            e.items_for_block(0, 16),
            vec![
                ExtraItem::Multimodal {
                    id: "img".into(),
                    offset: 4
                },
                ExtraItem::Str("s".into())
            ]
        );
        assert_eq!(
            e.items_for_block(1, 16),
            vec![ExtraItem::Multimodal {
                id: "img".into(),
                offset: -12
            }]
        );
        assert!(e.items_for_block(2, 16).is_empty());
        assert_eq!(e.digest_for_block(2, 16), 0);
    }
}
