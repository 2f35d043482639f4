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
//!
//! SGLang (≥ 0.5.6) chains pages differently: a page's digest is SHA-256
//! over the parent page's 32-byte digest (nothing for the first page)
//! followed by the page's token ids as little-endian u32, and the event
//! carries the *first* 8 bytes read big-endian as a signed int
//! ([`Digest::sglang_id`]); no seed, so every pod agrees
//! ([`BlockHasher::sglang`], checked against `testdata/kv-events/sglang-*`).

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

    /// SGLang's int form: the first 8 bytes, big-endian, as a signed int.
    pub fn sglang_id(&self) -> i64 {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.0[..8]);
        i64::from_be_bytes(head)
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

/// Chains block hashes the way vLLM's `sha256_cbor` does, or the way
/// SGLang chains pages.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    scheme: Scheme,
    block_size: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scheme {
    /// vLLM `sha256_cbor` from this NONE_HASH.
    Vllm { none_hash: Digest },
    /// SGLang's SHA-256 page chain.
    Sglang,
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
            scheme: Scheme::Vllm {
                none_hash: Digest(Sha256::digest(&buf).into()),
            },
            block_size,
        }
    }

    /// A hasher for SGLang's `block_size`-token pages.
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn sglang(block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        BlockHasher {
            scheme: Scheme::Sglang,
            block_size,
        }
    }

    /// The virtual parent of every sequence's first block (vLLM), `None`
    /// for SGLang's chain, which has none.
    pub fn none_hash(&self) -> Option<Digest> {
        match self.scheme {
            Scheme::Vllm { none_hash } => Some(none_hash),
            Scheme::Sglang => None,
        }
    }

    /// The 64-bit id the engine's int-form events carry for `d`, as
    /// `BlockHash::id` normalises it: vLLM's last 8 bytes, or SGLang's
    /// signed first 8 bytes in two's complement.
    pub fn wire_id(&self, d: &Digest) -> u64 {
        match self.scheme {
            Scheme::Vllm { .. } => d.id(),
            Scheme::Sglang => d.sglang_id() as u64,
        }
    }

    /// Whether this is SGLang's page chain.
    pub fn is_sglang(&self) -> bool {
        self.scheme == Scheme::Sglang
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of one block given its parent (`None` = first block).
    pub fn hash_block(&self, parent: Option<&Digest>, tokens: &[u32]) -> Digest {
        let none_hash = match self.scheme {
            Scheme::Vllm { none_hash } => none_hash,
            Scheme::Sglang => {
                let mut h = Sha256::new();
                if let Some(p) = parent {
                    h.update(p.0);
                }
                for &t in tokens {
                    h.update(t.to_le_bytes());
                }
                return Digest(h.finalize().into());
            }
        };
        let parent = parent.unwrap_or(&none_hash);
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
            h.none_hash().expect("vLLM has one").hex(),
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

    #[test]
    fn sglang_page_chain_matches_sglang_0_5_23() {
        // testdata/kv-events/sglang-0.5.23/stored_chain.msgpack: the first
        // page of the fixtures' request A and its published hash.
        let page: Vec<u32> = vec![
            128_000, 7920, 112_649, 89378, 66107, 42836, 19565, 124_294, 101_023, 77752, 54481,
            31210, 7939, 112_668, 89397, 66126,
        ];
        let h = BlockHasher::sglang(16);
        let d = h.hash_block(None, &page);
        assert_eq!(d.sglang_id(), -6_399_529_968_389_209_982);
        assert_eq!(h.wire_id(&d), (-6_399_529_968_389_209_982_i64) as u64);
        assert!(h.none_hash().is_none());
        let next = h.hash_block(Some(&d), &page);
        assert_ne!(next, d, "chained on the parent");
    }
}
