//! Prints the token ids vLLM would compute for an OpenAI request body.
//!
//! ```text
//! cargo run -p kinference-tokenize --example tokenize -- \
//!     --tokenizer testdata/tokenizers/qwen3 --request body.json
//! echo '{"prompt": "Hello"}' | cargo run -p kinference-tokenize --example tokenize -- \
//!     --tokenizer testdata/tokenizers/gpt2 --request -
//! ```
//!
//! Output: one JSON object `{"prompt": <rendered chat prompt or null>,
//! "token_ids": [...]}`; for a completion with a list of prompts,
//! `token_ids` is a list of lists (one per prompt).

use std::io::Read as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use kinference_tokenize::{Endpoint, ModelTokenizer};

#[derive(Parser, Debug)]
#[command(about = "Print the token ids vLLM computes for an OpenAI request body")]
struct Args {
    /// Directory holding tokenizer.json and tokenizer_config.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// The request body (JSON); `-` reads standard input.
    #[arg(long)]
    request: String,
    /// The endpoint the body is for; by default detected from its fields
    /// (`messages`: chat, `prompt`: completion).
    #[arg(long, value_enum)]
    endpoint: Option<EndpointArg>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EndpointArg {
    Completions,
    Chat,
    Tokenize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tokenizer = ModelTokenizer::from_dir(&args.tokenizer)
        .with_context(|| format!("loading the tokenizer in {}", args.tokenizer.display()))?;
    let mut body = Vec::new();
    if args.request == "-" {
        std::io::stdin()
            .read_to_end(&mut body)
            .context("reading the request from standard input")?;
    } else {
        body = std::fs::read(&args.request).with_context(|| format!("reading {}", args.request))?;
    }
    let endpoint = args.endpoint.map(|e| match e {
        EndpointArg::Completions => Endpoint::Completions,
        EndpointArg::Chat => Endpoint::ChatCompletions,
        EndpointArg::Tokenize => Endpoint::Tokenize,
    });
    let tokenized = tokenizer.tokenize_bytes(endpoint, &body)?;
    let token_ids = match tokenized.token_ids.as_slice() {
        [one] => serde_json::json!(one),
        many => serde_json::json!(many),
    };
    let out = serde_json::json!({"prompt": tokenized.prompt, "token_ids": token_ids});
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
