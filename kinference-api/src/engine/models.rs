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
}
