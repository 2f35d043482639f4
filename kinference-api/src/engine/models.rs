//! `GET /v1/models`: the OpenAI model list vLLM and SGLang serve.

use serde::Deserialize;

use super::WireError;

/// One entry of an OpenAI model list.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct ModelCard {
    /// The name clients send in `model` (a served name or a LoRA adapter).
    pub id: String,
    /// Context length; vLLM sets it on base models only.
    #[serde(default)]
    pub max_model_len: Option<u64>,
    /// For a LoRA adapter: the base model's name.
    #[serde(default)]
    pub parent: Option<String>,
    /// The `--model` value (a hub id or a path).
    #[serde(default)]
    pub root: Option<String>,
    /// Who serves it (`vllm`, `sglang`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owned_by: Option<String>,
}

/// Reads an OpenAI model list (`{"object": "list", "data": [...]}`).
/// Fields other than those of [`ModelCard`] are ignored; a negative or
/// fractional `max_model_len` is an error.
///
/// # Errors
/// [`WireError::Json`] when `body` is not a model list.
pub fn parse_models(body: &[u8]) -> Result<Vec<ModelCard>, WireError> {
    #[derive(Deserialize)]
    struct List {
        data: Vec<ModelCard>,
    }
    serde_json::from_slice::<List>(body)
        .map(|l| l.data)
        .map_err(|e| WireError::json("/v1/models", &e))
}

/// An engine's release, from its `GET /version` (`{"version": "0.33.0"}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl Version {
    /// `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// Parses `0.33.0`, `0.26.1rc2`, `0.11.0+cu128` (suffixes ignored).
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.trim().trim_start_matches('v').split('.');
        let num = |p: Option<&str>| -> Option<u32> {
            let p = p?;
            let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        };
        let major = num(parts.next())?;
        let minor = num(parts.next())?;
        let patch = num(parts.next()).unwrap_or(0);
        Some(Self::new(major, minor, patch))
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Reads `GET /version`.
///
/// # Errors
/// [`WireError::Json`] when the body is not `{"version": "X.Y.Z"}`.
pub fn parse_version(body: &[u8]) -> Result<Version, WireError> {
    #[derive(Deserialize)]
    struct V {
        version: String,
    }
    let v: V = serde_json::from_slice(body).map_err(|e| WireError::json("/version", &e))?;
    Version::parse(&v.version).ok_or_else(|| WireError::shape("/version", "not a release number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_lists() {
        let vllm = br#"{"object":"list","data":[
            {"id":"Qwen/Qwen3-8B","object":"model","created":1,"owned_by":"vllm","root":"Qwen/Qwen3-8B","parent":null,"max_model_len":40960,"permission":[]},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"Qwen/Qwen3-8B","max_model_len":null}]}"#;
        let m = parse_models(vllm).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].max_model_len, Some(40960));
        assert_eq!(m[1].parent.as_deref(), Some("Qwen/Qwen3-8B"));
        let sglang = br#"{"object":"list","data":[{"id":"qwen","object":"model","created":1,"owned_by":"sglang","root":"Qwen/Qwen3-8B","max_model_len":32768}]}"#;
        assert_eq!(
            parse_models(sglang).unwrap()[0].root.as_deref(),
            Some("Qwen/Qwen3-8B")
        );
        for bad in [
            &b"{\"object\":\"error\"}"[..],
            b"[]",
            b"not json",
            br#"{"data":[{"id":"m","max_model_len":-1}]}"#,
        ] {
            assert!(matches!(
                parse_models(bad),
                Err(WireError::Json {
                    endpoint: "/v1/models",
                    ..
                })
            ));
        }
    }

    #[test]
    fn versions() {
        assert_eq!(
            parse_version(br#"{"version":"0.33.0"}"#).unwrap(),
            Version::new(0, 33, 0)
        );
        assert_eq!(Version::parse("0.26.1rc2"), Some(Version::new(0, 26, 1)));
        assert_eq!(Version::parse("0.11.0+cu128"), Some(Version::new(0, 11, 0)));
        assert_eq!(Version::parse("0.9"), Some(Version::new(0, 9, 0)));
        assert!(Version::new(0, 26, 0) > Version::new(0, 25, 9));
        assert!(parse_version(b"{}").is_err() && parse_version(br#"{"version":"dev"}"#).is_err());
    }
}
