//! vLLM's block hashes with `--prefix-caching-hash-algo sha256_cbor`.
//!
//! A block's hash is SHA-256 over the canonical CBOR encoding of the
//! three-element array `[parent digest (bytes, 32), [token ids], extra]`,
//! where `extra` is CBOR `null` for a plain request (no LoRA, multimodal
//! item or cache salt) and, for a LoRA request, the one-item array of its
//! adapter key ([`HashExtra::lora`]: `[["lora", name, path]]` from vLLM
//! 0.31, `[name]` before; the simulator serves no multimodal items or cache
//! salts). So an adapter's blocks never share a hash with the base
//! model's or another adapter's. The first block
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

/// The extra keys every block of a request mixes into its hash (vLLM's
/// `extra_keys` tuple, the third element of the hashed array), encoded as
/// canonical CBOR once per adapter.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct HashExtra(Vec<u8>);

impl HashExtra {
    /// A LoRA adapter's key, the same on every block of its requests: from
    /// vLLM 0.31 the tagged item `("lora", name, path)` (`tagged`), before
    /// that (0.12–0.30) the bare adapter name (`shared/specs/kv-events.md`
    /// §4.3). The tagged form reproduces the `sha256_cbor`
    /// `stored_lora_medium` fixture of vLLM 0.33 (`sql-lora` at
    /// `/adapters/sql-lora`).
    pub fn lora(name: &str, path: &str, tagged: bool) -> Self {
        let mut buf = Vec::with_capacity(16 + name.len() + path.len());
        cbor_head(&mut buf, 4, 1); // the extra-keys tuple: one item
        if tagged {
            cbor_head(&mut buf, 4, 3);
            cbor_text(&mut buf, "lora");
            cbor_text(&mut buf, name);
            cbor_text(&mut buf, path);
        } else {
            cbor_text(&mut buf, name);
        }
        HashExtra(buf)
    }

    /// The CBOR bytes hashed in place of `null`.
    pub fn cbor(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for HashExtra {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HashExtra({} CBOR bytes)", self.0.len())
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
        cbor_text(&mut buf, seed);
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

    /// The hash of one block of a plain request given its parent (`None` =
    /// first block).
    pub fn hash_block(&self, parent: Option<&Digest>, tokens: &[u32]) -> Digest {
        self.hash_block_with(parent, tokens, None)
    }

    /// The hash of one block with the request's extra keys (`None`: a plain
    /// request, CBOR `null`). SGLang's page chain has no extra keys (the
    /// simulator serves no adapters in SGLang mode): `extra` is ignored.
    pub fn hash_block_with(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extra: Option<&HashExtra>,
    ) -> Digest {
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
        match extra {
            None => buf.push(0xf6), // null: no extra keys
            Some(e) => buf.extend_from_slice(e.cbor()),
        }
        Digest(Sha256::digest(&buf).into())
    }

    /// Extends `hashes` (the digests of the first `hashes.len()` full blocks
    /// of `tokens`) to cover every full block of `tokens`.
    pub fn extend(&self, tokens: &[u32], hashes: &mut Vec<Digest>) {
        self.extend_with(tokens, hashes, None);
    }

    /// [`BlockHasher::extend`] for a request with extra keys.
    pub fn extend_with(&self, tokens: &[u32], hashes: &mut Vec<Digest>, extra: Option<&HashExtra>) {
        let full = tokens.len() / self.block_size;
        while hashes.len() < full {
            let i = hashes.len();
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let h = self.hash_block_with(hashes.last(), block, extra);
            hashes.push(h);
        }
    }
}

/// Writes a CBOR text string.
fn cbor_text(buf: &mut Vec<u8>, s: &str) {
    cbor_head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
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

    /// The fixtures' LoRA request (`stored_lora_medium`, set
    /// `vllm-0.33.0/sha256_cbor-bytes`): adapter `sql-lora` at
    /// `/adapters/sql-lora`, two blocks.
    #[test]
    fn lora_blocks_match_vllm_0_33() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../testdata/kv-events/manifest.json"
        );
        let text = std::fs::read_to_string(path).expect("the manifest is readable");
        let manifest: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let entry = manifest["fixtures"]
            .as_array()
            .expect("fixtures")
            .iter()
            .find(|f| f["file"] == "vllm-0.33.0/sha256_cbor-bytes/stored_lora_medium.msgpack")
            .expect("the LoRA fixture is listed");
        let ev = &entry["normalized"]["events"][0];
        assert_eq!(ev["lora_name"], "sql-lora");
        let tokens: Vec<u32> = ev["token_ids"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect();
        let want: Vec<&str> = ev["block_hashes"]
            .as_array()
            .expect("hashes")
            .iter()
            .map(|h| h["$bin"].as_str().expect("bytes"))
            .collect();
        let h = BlockHasher::new(16, DEFAULT_HASH_SEED);
        let extra = HashExtra::lora("sql-lora", "/adapters/sql-lora", true);
        let mut got = Vec::new();
        h.extend_with(&tokens, &mut got, Some(&extra));
        assert_eq!(got.iter().map(Digest::hex).collect::<Vec<_>>(), want);
        // Base-model hashes of the same tokens are untouched by the change.
        let mut base = Vec::new();
        h.extend(&tokens, &mut base);
        assert_ne!(base, got);
        assert_eq!(base[0], h.hash_block_with(None, &tokens[..16], None));
    }

    #[test]
    fn lora_keys_separate_adapters_and_releases() {
        let tagged = HashExtra::lora("a", "/p", true);
        assert_eq!(
            tagged.cbor(),
            [
                0x81, 0x83, 0x64, b'l', b'o', b'r', b'a', 0x61, b'a', 0x62, b'/', b'p'
            ]
        );
        let bare = HashExtra::lora("a", "/p", false);
        assert_eq!(bare.cbor(), [0x81, 0x61, b'a']);
        let h = BlockHasher::new(2, DEFAULT_HASH_SEED);
        let t = [1, 2];
        let ids = [
            h.hash_block(None, &t),
            h.hash_block_with(None, &t, Some(&tagged)),
            h.hash_block_with(None, &t, Some(&bare)),
            h.hash_block_with(None, &t, Some(&HashExtra::lora("b", "/p", true))),
            h.hash_block_with(None, &t, Some(&HashExtra::lora("a", "/q", true))),
        ];
        for (i, a) in ids.iter().enumerate() {
            for b in &ids[i + 1..] {
                assert_ne!(a, b);
            }
        }
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
