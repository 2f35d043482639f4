//! Engine-agnostic KV-cache events, as decoded from vLLM or SGLang batches
//! (see `shared/specs/kv-events.md` §2–3) and as the simulator encodes them.
//!
//! One [`EventBatch`] is the payload of one published message. Fields that
//! some releases lack are `Option`s; `None` means "absent or nil" (the
//! spec treats both alike). Hashes keep their wire form ([`BlockHash`]) so
//! tools can print them as sent; the index uses [`BlockHash::id`].

/// A generic MessagePack value, used where the wire carries free-form data
/// (vLLM's per-block `extra_keys`, SGLang's trailing metadata map).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// nil
    Nil,
    /// true/false
    Bool(bool),
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer (or one written with a signed marker).
    Int(i64),
    /// A float.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes (msgpack `bin`).
    Bin(Vec<u8>),
    /// An array.
    Array(Vec<Value>),
    /// A map, in wire order.
    Map(Vec<(Value, Value)>),
}

/// An engine's block hash as it appeared on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// An unsigned integer (vLLM's default int mode, `sha256_cbor_64bit`).
    Uint(u64),
    /// A signed integer (SGLang, vLLM's old `builtin` algorithm).
    Int(i64),
    /// Raw digest bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`):
    /// 32 bytes usually, 16 for xxhash, 64 for multi-group views in 0.12–0.23.
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The 64-bit id the index uses: integers as u64 (two's complement for
    /// negatives), bytes as their last 8 bytes read big-endian, zero-padded
    /// on the left when shorter. This equals vLLM's int form of the same
    /// digest (spec §4.4), so int and bytes publishers agree.
    pub fn id(&self) -> u64 {
        match self {
            BlockHash::Uint(v) => *v,
            BlockHash::Int(v) => *v as u64,
            BlockHash::Bytes(b) => {
                let tail = &b[b.len().saturating_sub(8)..];
                tail.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x))
            }
        }
    }
}

impl From<u64> for BlockHash {
    fn from(v: u64) -> Self {
        BlockHash::Uint(v)
    }
}

/// Storage tier of a block (`medium` on the wire), fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory: `"GPU"`, or no medium at all.
    Gpu,
    /// Host memory: `"CPU"`, `"cpu"`, SGLang's `"CPU_PINNED"`.
    Cpu,
    /// The engine's local disk: SGLang's `"DISK"` (SSD/NVMe).
    Disk,
    /// File or object storage and shared pools: vLLM's `"STORAGE"` (its
    /// `fs`/`obj` offloading tiers), SGLang's `"EXTERNAL"` (e.g. Mooncake).
    Storage,
    /// Anything else (connector-specific names).
    Other,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 5] = [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Storage, Tier::Other];

    /// The tier a `medium` string names; `None` (nil/absent) is the GPU.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        let Some(m) = medium else { return Tier::Gpu };
        if m.eq_ignore_ascii_case("gpu") {
            Tier::Gpu
        } else if m.eq_ignore_ascii_case("cpu") || m.eq_ignore_ascii_case("cpu_pinned") {
            Tier::Cpu
        } else if m.eq_ignore_ascii_case("disk") {
            Tier::Disk
        } else if m.eq_ignore_ascii_case("storage") || m.eq_ignore_ascii_case("external") {
            Tier::Storage
        } else {
            Tier::Other
        }
    }

    /// The tier's bit in a tier mask.
    pub const fn bit(self) -> u8 {
        match self {
            Tier::Gpu => 1,
            Tier::Cpu => 2,
            Tier::Disk => 4,
            Tier::Storage => 8,
            Tier::Other => 16,
        }
    }
}

/// `BlockStored`: blocks that entered a tier. Field names and meaning as in
/// the spec (§3.1 vLLM, §3.4 SGLang).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// One hash per stored block, in prefix order.
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the block before the first one; `None` starts a sequence.
    pub parent_block_hash: Option<BlockHash>,
    /// All tokens of the stored blocks, concatenated. Empty for offload
    /// placeholders ("this hash now also lives in tier X").
    pub token_ids: Vec<u32>,
    /// Tokens per hash in this event (0 for placeholders).
    pub block_size: u32,
    /// Integer LoRA id (deprecated upstream, still sent).
    pub lora_id: Option<i64>,
    /// Storage tier name; `None` means GPU.
    pub medium: Option<String>,
    /// LoRA adapter name (vLLM ≥ 0.14, SGLang ≥ 0.5.22).
    pub lora_name: Option<String>,
    /// Per-block extra hash inputs as published (vLLM ≥ 0.17): one entry per
    /// block, each nil or a list of items (see [`crate::key::ExtraItem`]).
    pub extra_keys: Option<Vec<Option<Vec<Value>>>>,
    /// KV-cache group (vLLM ≥ 0.20); `None` is group 0.
    pub group_idx: Option<u32>,
    /// e.g. `full_attention`, `sliding_window` (vLLM ≥ 0.22).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window in tokens (vLLM ≥ 0.22).
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// `"LOCAL"`/`"REMOTE"` (vLLM ≥ 0.26).
    pub locality: Option<String>,
    /// Offload tier that generated the event (vLLM ≥ 0.29).
    pub ownership: Option<String>,
    /// Session of the triggering request (vLLM ≥ 0.30, SGLang ≥ 0.5.20).
    pub session_id: Option<String>,
    /// Per block, lookahead tokens that were also hashed (vLLM ≥ 0.33).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// SGLang's request cache salt (0.5.20+ field; 0.5.18–0.5.19 trailing map).
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`: blocks that left a tier.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Tier they left; `None` means GPU.
    pub medium: Option<String>,
    /// KV-cache group (vLLM ≥ 0.20).
    pub group_idx: Option<u32>,
    /// `"LOCAL"`/`"REMOTE"` (vLLM ≥ 0.26).
    pub locality: Option<String>,
    /// Offload tier that generated the event (vLLM ≥ 0.29).
    pub ownership: Option<String>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // events are transient; boxing would cost an allocation per event
pub enum KvEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// Everything this publisher had is gone (prefix-cache reset).
    AllBlocksCleared,
}

impl KvEvent {
    /// The wire tag of the event.
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// What a decoder skipped in a batch (counted, never fatal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Skipped {
    /// Events whose tag is unknown, or that are neither array nor map.
    pub unknown_events: u32,
    /// Map keys, or positional elements, the decoder does not know.
    pub unknown_fields: u32,
}

/// One decoded payload.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// Unix seconds at the end of the engine step.
    pub ts: f64,
    /// The events, in order (unknown ones left out and counted in `skipped`).
    pub events: Vec<KvEvent>,
    /// `data_parallel_rank` (vLLM) / `attn_dp_rank` (SGLang); `None` when nil
    /// and in vLLM 0.9.0's two-element batches.
    pub dp_rank: Option<i64>,
    /// Whether the batch had the third (rank) element at all.
    pub has_rank_field: bool,
    /// What was skipped while decoding.
    pub skipped: Skipped,
}
