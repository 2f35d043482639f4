//! Which real engine the simulator imitates: a family (vLLM or SGLang) and
//! a release. Every behaviour that differs between engines or releases is
//! decided here, from `shared/specs/kv-events.md` and the engines' released
//! sources, so the rest of the crate asks one question ("does this engine
//! serve `/kv_event_sources`?") instead of comparing versions itself.
//!
//! | behaviour | vLLM | SGLang |
//! |---|---|---|
//! | `GET /kv_event_sources` | ≥ 0.31 (404 before) | never (404) |
//! | `GET /server_info`, `/get_server_info` | never (404) | always; its `kv_events` object ≥ 0.5.22 |
//! | `POST /v1/embeddings`, `/v1/responses` | always | always |
//! | `POST /v1/messages` (Anthropic) | always | never (404) |
//! | event encoding | positional < 0.24, maps ≥ 0.24 | positional < 0.5.20, maps ≥ 0.5.20 |
//! | one event per block | `BlockRemoved` always | both kinds < 0.5.18; a node's pages coalesced ≥ 0.5.18 |
//! | replay reply frames | `[seq, payload]` < 0.26, `[topic, seq, payload]` ≥ 0.26 | same change at 0.5.22 |
//! | block hashes | `sha256_cbor` chain from NONE_HASH; int = last 8 bytes | SHA-256 page chain; int = first 8 bytes, signed |
//! | NONE_HASH without `PYTHONHASHSEED` | random per engine core < 0.29, `H("vllm-none-hash")` ≥ 0.29 | (no seed) |
//! | per-request `kv_cache_report_mode: "full"` | ≥ 0.26 | no |
//! | admission control (`--max-num-queued-reqs`, 503) | ≥ 0.29 | no |
//! | `--api-key` guards | paths under `/v1`, `/v2`, `/inference` (or every path but the public ones) | every path but `/health*`, `/metrics*` |
//! | `/metrics` names | `vllm:` | `sglang:` |
//! | LoRA adapters (`--lora-modules`) | served; a block's hash extra key is the adapter name < 0.31, `("lora", name, path)` ≥ 0.31 | refused |
//!
//! Releases older than the oldest modelled one (vLLM 0.22, SGLang 0.5.10)
//! are refused: their events have fewer fields than the simulator writes.
//! Newer releases than the newest modelled one behave like the newest.

use std::fmt;
use std::str::FromStr;

use kinference_kvindex::codec::frames::ReplayLayout;

/// An engine family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// vLLM (`vllm serve`).
    Vllm,
    /// SGLang (`python -m sglang.launch_server`).
    Sglang,
}

impl Family {
    /// Lower-case name, as in `owned_by` and the metric prefix.
    pub fn name(self) -> &'static str {
        match self {
            Family::Vllm => "vllm",
            Family::Sglang => "sglang",
        }
    }
}

/// A release number `major.minor.patch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major.
    pub major: u16,
    /// Minor.
    pub minor: u16,
    /// Patch.
    pub patch: u16,
}

impl Version {
    /// `major.minor.patch`.
    pub const fn new(major: u16, minor: u16, patch: u16) -> Self {
        Version {
            major,
            minor,
            patch,
        }
    }

    fn at_least(self, major: u16, minor: u16) -> bool {
        self >= Version::new(major, minor, 0)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for Version {
    type Err = String;

    /// `0.30`, `0.30.1` (a missing patch is 0).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a release number like 0.30 or 0.5.19");
        let mut parts = s.trim().split('.');
        let mut next = |required: bool| -> Result<u16, String> {
            match parts.next() {
                Some(p) => p.parse::<u16>().map_err(|_| bad()),
                None if required => Err(bad()),
                None => Ok(0),
            }
        };
        let v = Version::new(next(true)?, next(true)?, next(false)?);
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(v)
    }
}

/// The engine family and release the simulator imitates. The default is
/// vLLM 0.33.0, the newest release whose formats the fixtures hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineMode {
    /// vLLM or SGLang.
    pub family: Family,
    /// The release.
    pub version: Version,
}

/// The newest vLLM release modelled.
pub const VLLM_LATEST: Version = Version::new(0, 33, 0);
/// The oldest vLLM release modelled (the last positional event layout).
pub const VLLM_OLDEST: Version = Version::new(0, 22, 0);
/// The newest SGLang release modelled.
pub const SGLANG_LATEST: Version = Version::new(0, 5, 23);
/// The oldest SGLang release modelled (`medium` in every event).
pub const SGLANG_OLDEST: Version = Version::new(0, 5, 10);

impl Default for EngineMode {
    fn default() -> Self {
        EngineMode::vllm(VLLM_LATEST)
    }
}

impl fmt::Display for EngineMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.family.name(), self.version)
    }
}

impl FromStr for EngineMode {
    type Err = String;

    /// `vllm`, `sglang` (their newest modelled release), `vllm:0.30`,
    /// `vllm@0.30.1`, `sglang:0.5.19`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, version) = match s.find([':', '@', '=']) {
            Some(at) => (&s[..at], Some(&s[at + 1..])),
            None => (s, None),
        };
        let mode = match name.trim().to_ascii_lowercase().as_str() {
            "vllm" => EngineMode::vllm(match version {
                Some(v) => v.parse()?,
                None => VLLM_LATEST,
            }),
            "sglang" => EngineMode::sglang(match version {
                Some(v) => v.parse()?,
                None => SGLANG_LATEST,
            }),
            other => {
                return Err(format!(
                    "unknown engine `{other}`: use vllm[:VERSION] or sglang[:VERSION]"
                ));
            }
        };
        mode.check()?;
        Ok(mode)
    }
}

/// The wire form of KV events an engine writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireForm {
    /// vLLM ≥ 0.24: maps.
    VllmMap,
    /// vLLM 0.22–0.23: 12-element positional `BlockStored`.
    VllmArray,
    /// SGLang 0.5.10–0.5.19: positional, with `medium`.
    SglangArray,
    /// SGLang ≥ 0.5.20: maps.
    SglangMap,
}

/// Which paths `--api-key` guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ApiKeyScope {
    /// The engine's own rule for its release: vLLM guards the OpenAI paths
    /// (`/v1…`, `/v2…`, `/inference…`) and leaves `/tokenize`,
    /// `/metrics`, `/health`, `/kv_event_sources` open; SGLang guards every
    /// path except `/health…` and `/metrics…`.
    #[default]
    EngineDefault,
    /// vLLM's newer middleware (its development branch after 0.33): every
    /// route except `/health`, `/ping`, `/load`, `/version`, `/metrics`
    /// and the API docs.
    AllButPublic,
}

impl FromStr for ApiKeyScope {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "engine" | "default" | "v1" => Ok(ApiKeyScope::EngineDefault),
            "all" | "all-but-public" => Ok(ApiKeyScope::AllButPublic),
            _ => Err(format!(
                "unknown api key scope `{s}`: use engine (the release's own rule) or all-but-public"
            )),
        }
    }
}

impl EngineMode {
    /// vLLM at `version`.
    pub const fn vllm(version: Version) -> Self {
        EngineMode {
            family: Family::Vllm,
            version,
        }
    }

    /// SGLang at `version`.
    pub const fn sglang(version: Version) -> Self {
        EngineMode {
            family: Family::Sglang,
            version,
        }
    }

    /// Whether the release is modelled.
    ///
    /// # Errors
    /// A message naming the oldest modelled release.
    pub fn check(&self) -> Result<(), String> {
        let oldest = match self.family {
            Family::Vllm => VLLM_OLDEST,
            Family::Sglang => SGLANG_OLDEST,
        };
        if self.version < oldest {
            return Err(format!(
                "{self} is not modelled: the oldest {} release the simulator reproduces is {oldest}",
                self.family.name()
            ));
        }
        Ok(())
    }

    /// vLLM?
    pub fn is_vllm(&self) -> bool {
        self.family == Family::Vllm
    }

    /// SGLang?
    pub fn is_sglang(&self) -> bool {
        self.family == Family::Sglang
    }

    /// `GET /kv_event_sources` exists (vLLM ≥ 0.31).
    pub fn serves_kv_event_sources(&self) -> bool {
        self.is_vllm() && self.version.at_least(0, 31)
    }

    /// `POST /v1/messages`, Anthropic's Messages API: vLLM (every modelled
    /// release); SGLang serves only the OpenAI APIs (`/v1/embeddings` and
    /// `/v1/responses` are served by both).
    pub fn serves_anthropic_messages(&self) -> bool {
        self.is_vllm()
    }

    /// `GET /server_info` (and the older `/get_server_info`) exist: SGLang.
    pub fn serves_server_info(&self) -> bool {
        self.is_sglang()
    }

    /// `/server_info` describes the publisher in a `kv_events` object
    /// (SGLang ≥ 0.5.22, the release that added the `bind` and `format`
    /// keys; the exact release that added the object is not pinned down).
    pub fn server_info_has_kv_events(&self) -> bool {
        self.is_sglang() && self.version >= Version::new(0, 5, 22)
    }

    /// The event encoding.
    pub fn wire_form(&self) -> WireForm {
        match self.family {
            Family::Vllm if self.version.at_least(0, 24) => WireForm::VllmMap,
            Family::Vllm => WireForm::VllmArray,
            Family::Sglang if self.version >= Version::new(0, 5, 20) => WireForm::SglangMap,
            Family::Sglang => WireForm::SglangArray,
        }
    }

    /// The replay reply layout.
    pub fn replay_layout(&self) -> ReplayLayout {
        let new = match self.family {
            Family::Vllm => self.version.at_least(0, 26),
            Family::Sglang => self.version >= Version::new(0, 5, 22),
        };
        if new {
            ReplayLayout::TopicSeqPayload
        } else {
            ReplayLayout::SeqPayload
        }
    }

    /// SGLang before 0.5.18 publishes one event per page, stores and
    /// removals alike; later releases coalesce a radix node's pages.
    pub fn one_event_per_page(&self) -> bool {
        self.is_sglang() && self.version < Version::new(0, 5, 18)
    }

    /// The engine's cache is a set of prefixes (SGLang's radix tree): a
    /// block already cached is not stored again, and an eviction is
    /// reported only when the last copy goes. vLLM's block pool can hold
    /// one digest in two blocks and reports each.
    pub fn set_semantics(&self) -> bool {
        self.is_sglang()
    }

    /// Honours `vllm_xargs: {"kv_cache_report_mode": "full"}` (vLLM ≥ 0.26).
    pub fn honours_report_mode_full(&self) -> bool {
        self.is_vllm() && self.version.at_least(0, 26)
    }

    /// `BlockStored` carries the `session_id` of the request that stored
    /// (vLLM ≥ 0.30, SGLang ≥ 0.5.20).
    pub fn publishes_session_id(&self) -> bool {
        match self.family {
            Family::Vllm => self.version.at_least(0, 30),
            Family::Sglang => self.version >= Version::new(0, 5, 20),
        }
    }

    /// NONE_HASH is reproducible across pods without `PYTHONHASHSEED`
    /// (vLLM ≥ 0.29 with the SHA-256 algorithms).
    pub fn default_seed_is_fixed(&self) -> bool {
        self.is_vllm() && self.version.at_least(0, 29)
    }

    /// Has `--max-num-queued-reqs` / `--max-num-queued-tokens` (vLLM ≥ 0.29).
    pub fn has_admission_control(&self) -> bool {
        self.is_vllm() && self.version.at_least(0, 29)
    }

    /// Serves LoRA adapters (`--lora-modules`): vLLM. SGLang's own flags
    /// and page-hash namespacing differ and are not modelled.
    pub fn serves_lora(&self) -> bool {
        self.is_vllm()
    }

    /// A LoRA block's hash mixes in the tagged extra key `("lora", name,
    /// path)` (vLLM ≥ 0.31) instead of the bare adapter name (0.12–0.30).
    pub fn lora_hash_key_tagged(&self) -> bool {
        self.is_vllm() && self.version.at_least(0, 31)
    }

    /// The `/version` answer.
    pub fn version_string(&self) -> String {
        self.version.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_families_and_releases() {
        assert_eq!("vllm".parse(), Ok(EngineMode::vllm(VLLM_LATEST)));
        assert_eq!(
            "vllm:0.30".parse(),
            Ok(EngineMode::vllm(Version::new(0, 30, 0)))
        );
        assert_eq!(
            "VLLM@0.26.1".parse(),
            Ok(EngineMode::vllm(Version::new(0, 26, 1)))
        );
        assert_eq!(
            "sglang:0.5.19".parse(),
            Ok(EngineMode::sglang(Version::new(0, 5, 19)))
        );
        assert_eq!("sglang".parse(), Ok(EngineMode::sglang(SGLANG_LATEST)));
        assert!(
            "vllm:0.9"
                .parse::<EngineMode>()
                .unwrap_err()
                .contains("0.22.0")
        );
        assert!("sglang:0.4.10".parse::<EngineMode>().is_err());
        assert!(
            "tgi"
                .parse::<EngineMode>()
                .unwrap_err()
                .contains("unknown engine")
        );
        assert!("vllm:0.x".parse::<EngineMode>().is_err());
        assert!("vllm:0.3.0.1".parse::<EngineMode>().is_err());
    }

    #[test]
    fn release_boundaries() {
        let v = |s: &str| s.parse::<EngineMode>().expect("parses");
        assert!(!v("vllm:0.30.9").serves_kv_event_sources());
        assert!(v("vllm:0.31").serves_kv_event_sources());
        assert!(!v("sglang").serves_kv_event_sources());
        assert_eq!(v("vllm:0.23").wire_form(), WireForm::VllmArray);
        assert_eq!(v("vllm:0.24").wire_form(), WireForm::VllmMap);
        assert_eq!(v("sglang:0.5.19").wire_form(), WireForm::SglangArray);
        assert_eq!(v("sglang:0.5.20").wire_form(), WireForm::SglangMap);
        assert_eq!(v("vllm:0.25").replay_layout(), ReplayLayout::SeqPayload);
        assert_eq!(
            v("vllm:0.26").replay_layout(),
            ReplayLayout::TopicSeqPayload
        );
        assert_eq!(v("sglang:0.5.21").replay_layout(), ReplayLayout::SeqPayload);
        assert_eq!(
            v("sglang:0.5.22").replay_layout(),
            ReplayLayout::TopicSeqPayload
        );
        assert!(v("sglang:0.5.17").one_event_per_page());
        assert!(!v("sglang:0.5.18").one_event_per_page());
        assert!(!v("vllm:0.28").default_seed_is_fixed());
        assert!(v("vllm:0.29").default_seed_is_fixed());
        assert!(!v("vllm:0.25").honours_report_mode_full());
        assert!(v("vllm:0.26").honours_report_mode_full());
        assert!(!v("vllm:0.30.9").lora_hash_key_tagged());
        assert!(v("vllm:0.31").lora_hash_key_tagged());
        assert!(v("vllm:0.22").serves_lora() && !v("sglang").serves_lora());
    }
}
