//! vLLM's block hashes with `--prefix-caching-hash-algo sha256_cbor`.
//!
//! A block's hash is SHA-256 over the canonical CBOR encoding of the
//! three-element array `[parent digest (bytes, 32), [token ids], extra]`,
//! where `extra` is CBOR `null` for a plain request (no LoRA, multimodal
//! item or cache salt; the simulator serves none of those). The first block
//! of a sequence uses `NONE_HASH` as its parent: SHA-256 of the CBOR text
//! string of the hash seed (`"vllm-none-hash"` unless `PYTHONHASHSEED` is
//! set, vLLM ≥ 0.29). This is the only vLLM algorithm that can be reproduced
//! outside Python (see `shared/specs/kv-events.md` §4.2), so a simulator's
//! hashes equal a real engine's for the same token ids; the fixtures
//! (`testdata/kv-events/vllm-0.33.0/sha256_cbor-*`) check it.
//!
//! On the wire a digest is published either whole (32 bytes) or as vLLM's
//! default int form: the last 8 bytes read big-endian ([`Digest::id`]).

use sha2::{Digest as _, Sha256};

/// vLLM's default NONE_HASH seed (vLLM ≥ 0.29 without `PYTHONHASHSEED`).
pub const DEFAULT_HASH_SEED: &str = "vllm-none-hash";

/// A 32-byte block digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// vLLM's int form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the last 8
    /// bytes, big-endian.
    pub fn id(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }

    /// Lower-case hex of the 32 bytes.
    pub fn hex(&self) -> String {
        use std::fmt::Write as _;
        self.0.iter().fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Digest({})", self.hex())
    }
}

/// Chains block hashes the way vLLM's `sha256_cbor` does.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    none_hash: Digest,
    block_size: usize,
}

impl BlockHasher {
    /// A hasher for `block_size`-token blocks whose NONE_HASH derives from
    /// `seed` ([`DEFAULT_HASH_SEED`] for vLLM's default).
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn new(block_size: usize, seed: &str) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let mut buf = Vec::with_capacity(seed.len() + 9);
        cbor_head(&mut buf, 3, seed.len() as u64);
        buf.extend_from_slice(seed.as_bytes());
        BlockHasher {
            none_hash: Digest(Sha256::digest(&buf).into()),
            block_size,
        }
    }

    /// The virtual parent of every sequence's first block.
    pub fn none_hash(&self) -> Digest {
        self.none_hash
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of one block given its parent (`None` = first block).
    pub fn hash_block(&self, parent: Option<&Digest>, tokens: &[u32]) -> Digest {
        let parent = parent.unwrap_or(&self.none_hash);
        let mut buf = Vec::with_capacity(40 + tokens.len() * 5);
        buf.push(0x83); // array(3)
        buf.push(0x58); // bytes, 1-byte length
        buf.push(32);
        buf.extend_from_slice(&parent.0);
        cbor_head(&mut buf, 4, tokens.len() as u64);
        for &t in tokens {
            cbor_head(&mut buf, 0, u64::from(t));
        }
        buf.push(0xf6); // null: no extra keys
        Digest(Sha256::digest(&buf).into())
    }

    /// Extends `hashes` (the digests of the first `hashes.len()` full blocks
    /// of `tokens`) to cover every full block of `tokens`.
    pub fn extend(&self, tokens: &[u32], hashes: &mut Vec<Digest>) {
        let full = tokens.len() / self.block_size;
        while hashes.len() < full {
            let i = hashes.len();
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let h = self.hash_block(hashes.last(), block);
            hashes.push(h);
        }
    }
}

/// Writes a canonical (shortest-form) CBOR head of major type `major`.
fn cbor_head(buf: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    if value < 24 {
        buf.push(m | value as u8);
    } else if let Ok(v) = u8::try_from(value) {
        buf.push(m | 0x18);
        buf.push(v);
    } else if let Ok(v) = u16::try_from(value) {
        buf.push(m | 0x19);
        buf.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(value) {
        buf.push(m | 0x1a);
        buf.extend_from_slice(&v.to_be_bytes());
    } else {
        buf.push(m | 0x1b);
        buf.extend_from_slice(&value.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_matches_vllm_0_33() {
        // From testdata/kv-events/manifest.json, set vllm-0.33.0/sha256_cbor-*.
        let h = BlockHasher::new(16, DEFAULT_HASH_SEED);
        assert_eq!(
            h.none_hash().hex(),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }

    #[test]
    fn cbor_heads_are_shortest_form() {
        let mut b = Vec::new();
        cbor_head(&mut b, 0, 23);
        cbor_head(&mut b, 0, 24);
        cbor_head(&mut b, 0, 255);
        cbor_head(&mut b, 0, 256);
        cbor_head(&mut b, 0, 65_536);
        cbor_head(&mut b, 4, 16);
        assert_eq!(
            b,
            [
                0x17, 0x18, 24, 0x18, 255, 0x19, 1, 0, 0x1a, 0, 1, 0, 0, 0x90
            ]
        );
    }

    #[test]
    fn chaining_depends_on_the_parent() {
        let h = BlockHasher::new(2, DEFAULT_HASH_SEED);
        let mut a = Vec::new();
        h.extend(&[1, 2, 3, 4, 5], &mut a);
        assert_eq!(a.len(), 2);
        assert_eq!(a[1], h.hash_block(Some(&a[0]), &[3, 4]));
        assert_ne!(a[1], h.hash_block(None, &[3, 4]));
        let other_seed = BlockHasher::new(2, "0");
        assert_ne!(other_seed.hash_block(None, &[1, 2]), a[0]);
    }
}
