//! Errors: [`LoadError`] when a model's files are read, [`Error`] when a
//! request is tokenized.

use std::path::PathBuf;

/// A model's tokenizer files could not be loaded. Each variant names the
/// file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// A file could not be read from disk.
    #[error("cannot read {path}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A required file is absent (`tokenizer.json`).
    #[error("{file} is missing")]
    Missing {
        /// The file's name.
        file: &'static str,
    },
    /// A file is not valid JSON.
    #[error("{file} is not valid JSON")]
    Json {
        /// The file's name.
        file: &'static str,
        /// The parser's complaint, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// A file is not UTF-8 text.
    #[error("{file} is not UTF-8")]
    Utf8 {
        /// The file's name.
        file: &'static str,
    },
    /// `tokenizer.json` is JSON but not a tokenizer the `tokenizers` crate
    /// accepts.
    #[error("tokenizer.json is not a usable tokenizer: {0}")]
    Tokenizer(String),
    /// A field of a configuration file has the wrong shape.
    #[error("{file}: `{field}` {problem}")]
    Field {
        /// The file's name.
        file: &'static str,
        /// The field.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// The chat template does not compile.
    #[error("{file}: chat template `{name}` does not compile")]
    Template {
        /// The file it came from.
        file: &'static str,
        /// The template's name (`default` for a single template).
        name: String,
        /// minijinja's syntax error, with line.
        #[source]
        source: minijinja::Error,
    },
}

/// The transformers message vLLM answers a chat request with (HTTP 400)
/// when the model has no chat template.
pub const NO_CHAT_TEMPLATE_MESSAGE: &str = "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the tokenizer does not define one.";

/// A request could not be tokenized.
///
/// Every variant except [`Error::Tokenizer`] is the client's fault: vLLM
/// answers the same request with HTTP 400. The `Display` of
/// [`Error::NoChatTemplate`] and [`Error::TemplateRaised`] is the engine's
/// message verbatim (it is what a vLLM-compatible server must send back),
/// which is why those two are not lowercase.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The body is not a request this crate understands (a missing or
    /// mistyped field). The message names the field.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A message has a content part other than text (images, audio, …):
    /// its ids depend on the engine's multimodal processor.
    #[error("unsupported content part type `{0}`")]
    UnsupportedContent(String),
    /// A chat request for a model without a chat template.
    #[error("{}", NO_CHAT_TEMPLATE_MESSAGE)]
    NoChatTemplate,
    /// The request carries its own `chat_template` and this tokenizer was
    /// loaded without `trust_request_chat_template` (vLLM refuses such
    /// requests unless started with `--trust-request-chat-template`).
    #[error("chat template is passed with request, but request chat templates are not trusted")]
    UntrustedChatTemplate,
    /// The chat template called `raise_exception(message)`: the template
    /// rejects the conversation (e.g. roles that do not alternate).
    #[error("{0}")]
    TemplateRaised(String),
    /// The chat template failed for another reason (an undefined value, a
    /// type error, a request-supplied template that does not compile, …),
    /// or transformers' own checks around it failed (`continue_final_message`).
    #[error("chat template failed: {0}")]
    Template(String),
    /// The `tokenizers` crate failed to encode (should not happen for valid
    /// UTF-8 input; a server-side error).
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

impl Error {
    /// A short, stable label for metrics (`invalid_request`, …).
    pub fn reason(&self) -> &'static str {
        match self {
            Error::InvalidRequest(_) => "invalid_request",
            Error::UnsupportedContent(_) => "unsupported_content",
            Error::NoChatTemplate => "no_chat_template",
            Error::UntrustedChatTemplate => "untrusted_chat_template",
            Error::TemplateRaised(_) => "template_raised",
            Error::Template(_) => "template",
            Error::Tokenizer(_) => "tokenizer",
        }
    }

    /// Whether the engine would reject the same request (HTTP 400) rather
    /// than fail itself.
    pub fn is_client_error(&self) -> bool {
        !matches!(self, Error::Tokenizer(_))
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidRequest(message.into())
    }
}
