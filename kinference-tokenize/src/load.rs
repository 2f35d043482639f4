//! A model's tokenizer files: reading them (a directory or a ConfigMap's
//! entries) and interpreting `tokenizer_config.json` the way transformers
//! does.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value as Json};

use crate::error::LoadError;

/// `tokenizer.json`: the `tokenizers` pipeline (required).
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// `tokenizer_config.json`: chat template, special tokens, flags (optional).
pub const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
/// `chat_template.jinja`: the chat template in a file of its own (newer
/// repositories); it takes precedence over `tokenizer_config.json`'s.
pub const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
/// `special_tokens_map.json`: special tokens not set in
/// `tokenizer_config.json` (older repositories).
pub const SPECIAL_TOKENS_MAP_JSON: &str = "special_tokens_map.json";

/// The files this crate reads, in the order they are looked for.
pub const FILE_NAMES: [&str; 4] = [
    TOKENIZER_JSON,
    TOKENIZER_CONFIG_JSON,
    CHAT_TEMPLATE_JINJA,
    SPECIAL_TOKENS_MAP_JSON,
];

/// A model's tokenizer files by name: read from a directory, or given as
/// the entries of a Kubernetes ConfigMap (`data` and `binaryData` merged,
/// name → bytes). Names other than [`FILE_NAMES`] are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelFiles {
    files: BTreeMap<String, Vec<u8>>,
}

impl ModelFiles {
    /// Reads the known files present in `dir`.
    ///
    /// # Errors
    ///
    /// [`LoadError::Io`] if the directory or a present file cannot be read;
    /// [`LoadError::Missing`] without `tokenizer.json`.
    pub fn read_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let meta = std::fs::metadata(dir).map_err(|source| LoadError::Io {
            path: dir.to_owned(),
            source,
        })?;
        if !meta.is_dir() {
            return Err(LoadError::Io {
                path: dir.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
            });
        }
        let mut files = ModelFiles::default();
        for name in FILE_NAMES {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => files.insert(name, bytes),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(LoadError::Io { path, source }),
            }
        }
        if files.get(TOKENIZER_JSON).is_none() {
            return Err(LoadError::Missing {
                file: TOKENIZER_JSON,
            });
        }
        Ok(files)
    }

    /// Files from name → bytes pairs, e.g. a ConfigMap's `data` (as UTF-8
    /// bytes) and `binaryData`.
    pub fn from_entries<N, B>(entries: impl IntoIterator<Item = (N, B)>) -> Self
    where
        N: Into<String>,
        B: Into<Vec<u8>>,
    {
        let mut files = ModelFiles::default();
        for (name, bytes) in entries {
            files.insert(name, bytes);
        }
        files
    }

    /// Adds or replaces one file.
    pub fn insert(&mut self, name: impl Into<String>, bytes: impl Into<Vec<u8>>) {
        self.files.insert(name.into(), bytes.into());
    }

    /// One file's bytes.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.files.get(name).map(Vec::as_slice)
    }
}

/// The special-token attributes of a transformers tokenizer, in the order
/// `special_tokens_map` lists them.
const SPECIAL_ATTRIBUTES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// What this crate needs from `tokenizer_config.json` (and its companions).
#[derive(Clone, Debug, Default)]
pub(crate) struct TokenizerConfig {
    /// Named chat templates: `("default", source)` for a single template.
    pub(crate) chat_templates: Vec<(String, String)>,
    /// File the templates came from (for errors).
    pub(crate) template_file: &'static str,
    /// Special token attributes (`bos_token` …) that are set.
    pub(crate) special: Vec<(&'static str, String)>,
    /// `additional_special_tokens`.
    pub(crate) additional_special_tokens: Vec<String>,
    pub(crate) add_bos_token: Option<bool>,
    pub(crate) add_eos_token: Option<bool>,
    pub(crate) tokenizer_class: Option<String>,
    pub(crate) clean_up_tokenization_spaces: bool,
    pub(crate) split_special_tokens: bool,
    pub(crate) model_max_length: Option<u64>,
}

impl TokenizerConfig {
    pub(crate) fn from_files(files: &ModelFiles) -> Result<Self, LoadError> {
        let config = match files.get(TOKENIZER_CONFIG_JSON) {
            Some(bytes) => object_file(TOKENIZER_CONFIG_JSON, bytes)?,
            None => Map::new(),
        };
        let special_map = match files.get(SPECIAL_TOKENS_MAP_JSON) {
            Some(bytes) => object_file(SPECIAL_TOKENS_MAP_JSON, bytes)?,
            None => Map::new(),
        };
        let mut out = TokenizerConfig {
            template_file: TOKENIZER_CONFIG_JSON,
            ..TokenizerConfig::default()
        };

        match config.get("chat_template") {
            None | Some(Json::Null) => {}
            Some(Json::String(t)) => out.chat_templates.push(("default".into(), t.clone())),
            Some(Json::Array(list)) => {
                for item in list {
                    let name = item.get("name").and_then(Json::as_str);
                    let template = item.get("template").and_then(Json::as_str);
                    match (name, template) {
                        (Some(n), Some(t)) => out.chat_templates.push((n.into(), t.into())),
                        _ => {
                            return Err(field(
                                TOKENIZER_CONFIG_JSON,
                                "chat_template",
                                "must list objects with string `name` and `template`",
                            ));
                        }
                    }
                }
            }
            Some(_) => {
                return Err(field(
                    TOKENIZER_CONFIG_JSON,
                    "chat_template",
                    "must be a string or a list of named templates",
                ));
            }
        }
        if let Some(bytes) = files.get(CHAT_TEMPLATE_JINJA) {
            let source = std::str::from_utf8(bytes).map_err(|_| LoadError::Utf8 {
                file: CHAT_TEMPLATE_JINJA,
            })?;
            out.chat_templates.retain(|(name, _)| name != "default");
            out.chat_templates
                .insert(0, ("default".into(), source.to_owned()));
            out.template_file = CHAT_TEMPLATE_JINJA;
        }

        out.tokenizer_class = opt_string(&config, "tokenizer_class")?;
        let defaults = class_defaults(out.tokenizer_class.as_deref());
        for attr in SPECIAL_ATTRIBUTES {
            let (file, value) = if config.contains_key(attr) {
                (TOKENIZER_CONFIG_JSON, config.get(attr))
            } else {
                (SPECIAL_TOKENS_MAP_JSON, special_map.get(attr))
            };
            let token = match value {
                Some(v) => token_content(file, attr, v)?,
                None => defaults
                    .iter()
                    .find(|(a, _)| *a == attr)
                    .map(|(_, t)| (*t).to_owned()),
            };
            if let Some(token) = token.filter(|t| !t.is_empty()) {
                out.special.push((attr, token));
            }
        }
        let (file, additional) = if config.contains_key("additional_special_tokens") {
            (
                TOKENIZER_CONFIG_JSON,
                config.get("additional_special_tokens"),
            )
        } else {
            (
                SPECIAL_TOKENS_MAP_JSON,
                special_map.get("additional_special_tokens"),
            )
        };
        match additional {
            None | Some(Json::Null) => {}
            Some(Json::Array(items)) => {
                for item in items {
                    if let Some(t) = token_content(file, "additional_special_tokens", item)? {
                        out.additional_special_tokens.push(t);
                    }
                }
            }
            Some(_) => {
                return Err(field(file, "additional_special_tokens", "must be a list"));
            }
        }

        out.add_bos_token = opt_bool(&config, "add_bos_token")?;
        out.add_eos_token = opt_bool(&config, "add_eos_token")?;
        out.clean_up_tokenization_spaces =
            opt_bool(&config, "clean_up_tokenization_spaces")?.unwrap_or(false);
        out.split_special_tokens = opt_bool(&config, "split_special_tokens")?.unwrap_or(false);
        out.model_max_length = match config.get("model_max_length") {
            None | Some(Json::Null) => None,
            // transformers writes "no limit" as 1e30, which is not a u64.
            Some(Json::Number(n)) => n.as_u64(),
            Some(_) => {
                return Err(field(
                    TOKENIZER_CONFIG_JSON,
                    "model_max_length",
                    "must be a number",
                ));
            }
        };
        Ok(out)
    }

    /// transformers' `special_tokens_map`: the set special-token attributes
    /// and `additional_special_tokens` (when not empty), in that order.
    pub(crate) fn special_tokens_map(&self) -> Map<String, Json> {
        let mut map: Map<String, Json> = self
            .special
            .iter()
            .map(|(attr, token)| ((*attr).to_owned(), Json::from(token.as_str())))
            .collect();
        if !self.additional_special_tokens.is_empty() {
            map.insert(
                "additional_special_tokens".into(),
                Json::from(self.additional_special_tokens.clone()),
            );
        }
        map
    }

    pub(crate) fn special_token(&self, attr: &str) -> Option<&str> {
        self.special
            .iter()
            .find(|(a, _)| *a == attr)
            .map(|(_, t)| t.as_str())
    }

    /// Whether transformers rebuilds the post-processor from
    /// `add_bos_token`/`add_eos_token` for this tokenizer class (the
    /// Llama-family fast tokenizers do, in their constructor), and with
    /// which flags.
    pub(crate) fn bos_eos_rewrite(&self) -> Option<(bool, bool)> {
        let class = self.tokenizer_class.as_deref()?;
        let class = class.strip_suffix("Fast").unwrap_or(class);
        matches!(
            class,
            "LlamaTokenizer" | "CodeLlamaTokenizer" | "GemmaTokenizer" | "CohereTokenizer"
        )
        .then(|| {
            (
                self.add_bos_token.unwrap_or(true),
                self.add_eos_token.unwrap_or(false),
            )
        })
    }
}

/// Constructor defaults of common tokenizer classes for special tokens the
/// config does not mention.
fn class_defaults(class: Option<&str>) -> &'static [(&'static str, &'static str)] {
    let Some(class) = class else { return &[] };
    match class.strip_suffix("Fast").unwrap_or(class) {
        "GPT2Tokenizer" => &[
            ("bos_token", "<|endoftext|>"),
            ("eos_token", "<|endoftext|>"),
            ("unk_token", "<|endoftext|>"),
        ],
        "Qwen2Tokenizer" => &[
            ("eos_token", "<|endoftext|>"),
            ("unk_token", "<|endoftext|>"),
            ("pad_token", "<|endoftext|>"),
        ],
        "LlamaTokenizer" | "CodeLlamaTokenizer" => &[
            ("bos_token", "<s>"),
            ("eos_token", "</s>"),
            ("unk_token", "<unk>"),
        ],
        "GemmaTokenizer" => &[
            ("bos_token", "<bos>"),
            ("eos_token", "<eos>"),
            ("unk_token", "<unk>"),
            ("pad_token", "<pad>"),
        ],
        _ => &[],
    }
}

fn object_file(file: &'static str, bytes: &[u8]) -> Result<Map<String, Json>, LoadError> {
    match serde_json::from_slice::<Json>(bytes)
        .map_err(|source| LoadError::Json { file, source })?
    {
        Json::Object(map) => Ok(map),
        _ => Err(field(file, "(top level)", "must be a JSON object")),
    }
}

fn field(file: &'static str, name: &str, problem: &str) -> LoadError {
    LoadError::Field {
        file,
        field: name.to_owned(),
        problem: problem.to_owned(),
    }
}

/// A special token written as a string or as an `AddedToken` object.
fn token_content(
    file: &'static str,
    attr: &str,
    value: &Json,
) -> Result<Option<String>, LoadError> {
    match value {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Object(obj) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(field(
                file,
                attr,
                "must be a string or an object with a string `content`",
            )),
        },
        _ => Err(field(
            file,
            attr,
            "must be a string or an object with a string `content`",
        )),
    }
}

fn opt_bool(config: &Map<String, Json>, key: &str) -> Result<Option<bool>, LoadError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(field(TOKENIZER_CONFIG_JSON, key, "must be a boolean")),
    }
}

fn opt_string(config: &Map<String, Json>, key: &str) -> Result<Option<String>, LoadError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(field(TOKENIZER_CONFIG_JSON, key, "must be a string")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[allow(clippy::needless_pass_by_value)] // test helper over `json!` literals
    fn config(cfg: Json) -> Result<TokenizerConfig, LoadError> {
        TokenizerConfig::from_files(&ModelFiles::from_entries([(
            TOKENIZER_CONFIG_JSON,
            cfg.to_string().into_bytes(),
        )]))
    }

    #[test]
    fn special_tokens_map_like_transformers() {
        let c = config(json!({
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": null,
            "unk_token": null,
            "eos_token": {"content": "<|im_end|>", "lstrip": false},
            "additional_special_tokens": ["<a>", {"content": "<b>"}],
        }))
        .unwrap();
        assert_eq!(
            Json::Object(c.special_tokens_map()),
            json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": ["<a>", "<b>"]})
        );
        let keys: Vec<String> = c.special_tokens_map().keys().cloned().collect();
        assert_eq!(
            keys,
            ["eos_token", "pad_token", "additional_special_tokens"]
        );
    }

    #[test]
    fn special_tokens_map_json_fills_gaps() {
        let files = ModelFiles::from_entries([
            (TOKENIZER_CONFIG_JSON, br#"{"eos_token": "</s>"}"#.to_vec()),
            (
                SPECIAL_TOKENS_MAP_JSON,
                br#"{"eos_token": "X", "bos_token": {"content": "<s>"}}"#.to_vec(),
            ),
        ]);
        let c = TokenizerConfig::from_files(&files).unwrap();
        assert_eq!(c.special_token("bos_token"), Some("<s>"));
        assert_eq!(c.special_token("eos_token"), Some("</s>"));
    }

    #[test]
    fn chat_templates_single_named_and_file() {
        let c = config(json!({"chat_template": "T"})).unwrap();
        assert_eq!(
            c.chat_templates,
            vec![("default".to_string(), "T".to_string())]
        );
        let c = config(json!({"chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]})).unwrap();
        assert_eq!(c.chat_templates.len(), 2);
        let files = ModelFiles::from_entries([
            (
                TOKENIZER_CONFIG_JSON,
                br#"{"chat_template": "old"}"#.to_vec(),
            ),
            (CHAT_TEMPLATE_JINJA, b"new".to_vec()),
        ]);
        let c = TokenizerConfig::from_files(&files).unwrap();
        assert_eq!(
            c.chat_templates,
            vec![("default".to_string(), "new".to_string())]
        );
        assert_eq!(c.template_file, CHAT_TEMPLATE_JINJA);
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = config(json!({"chat_template": 3})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tokenizer_config.json: `chat_template` must be a string or a list of named templates"
        );
        let e = config(json!({"add_bos_token": "yes"})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tokenizer_config.json: `add_bos_token` must be a boolean"
        );
        let e = TokenizerConfig::from_files(&ModelFiles::from_entries([(
            TOKENIZER_CONFIG_JSON,
            b"{oops".to_vec(),
        )]))
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("tokenizer_config.json is not valid JSON"),
            "{e}"
        );
        let e = ModelFiles::read_dir("/nonexistent/kinference").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot read /nonexistent/kinference"),
            "{e}"
        );
    }

    #[test]
    fn llama_family_rewrites_bos() {
        assert_eq!(
            config(json!({"tokenizer_class": "LlamaTokenizerFast"}))
                .unwrap()
                .bos_eos_rewrite(),
            Some((true, false))
        );
        assert_eq!(
            config(json!({"tokenizer_class": "LlamaTokenizer", "add_bos_token": false, "add_eos_token": true}))
                .unwrap()
                .bos_eos_rewrite(),
            Some((false, true))
        );
        assert_eq!(
            config(json!({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": true}))
                .unwrap()
                .bos_eos_rewrite(),
            None
        );
    }
}
