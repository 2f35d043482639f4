//! Writes the word-level benchmark tokenizer (`tokenizer.json` and
//! `tokenizer_config.json`) into a directory.
//!
//! ```text
//! cargo run -p kinference-tokenize --example word_level -- examples/word-level
//! ```
//!
//! The copy committed under `examples/word-level/` is checked against the
//! generator by the crate's tests.

use std::path::PathBuf;

use anyhow::Context as _;
use kinference_tokenize::{TOKENIZER_CONFIG_JSON, TOKENIZER_JSON, word_level};

fn main() -> anyhow::Result<()> {
    let dir: PathBuf = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .context("usage: word_level DIR")?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, text) in [
        (TOKENIZER_JSON, word_level::tokenizer_json()),
        (TOKENIZER_CONFIG_JSON, word_level::tokenizer_config_json()),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
