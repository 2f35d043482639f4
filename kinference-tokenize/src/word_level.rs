//! A cheap word-level tokenizer for benchmarks and simulations.
//!
//! It goes through the same loading, chat rendering and caching path as a
//! real model, but its model is a `WordLevel` lookup after a `Whitespace`
//! pre-tokenizer (`\w+|[^\w\s]+`), so tokenizing costs a hash lookup per
//! word instead of BPE merges. Prompts made of the words `w0` … `w65535`
//! (and the common English words, numbers and punctuation in the
//! vocabulary) tokenize one word = one token; anything else is `<unk>`.
//!
//! Ids: the special tokens first ([`SPECIAL_TOKENS`], ids 0–5), then `w{n}`
//! at id [`NUMBERED_WORD_BASE`]` + n`, then the rest. Its chat template is
//! ChatML without tools:
//! `<|im_start|>{role}\n{content}<|im_end|>\n` per message, plus
//! `<|im_start|>assistant\n` with `add_generation_prompt`; the newlines are
//! whitespace to this tokenizer, so a message costs its words plus three ids
//! and the generation prompt two.
//!
//! A copy of [`tokenizer_json`] and [`tokenizer_config_json`] is committed
//! under `examples/word-level/` at the workspace root (a test keeps them in
//! step), for engines and routers started from a directory.

use std::collections::HashMap;

use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::LoadError;
use crate::load::{ModelFiles, TOKENIZER_CONFIG_JSON, TOKENIZER_JSON};
use crate::tokenizer::{ModelTokenizer, Options};

/// Special tokens, ids 0 to 5.
pub const SPECIAL_TOKENS: [&str; 6] = [
    "<unk>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
];

/// Number of numbered words `w0` … `w65535`.
pub const NUMBERED_WORDS: u32 = 65_536;

/// Id of `w0`; `w{n}` has id `NUMBERED_WORD_BASE + n`.
pub const NUMBERED_WORD_BASE: u32 = SPECIAL_TOKENS.len() as u32;

/// The chat template (ChatML, no tools).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

/// Common English words (also added capitalised).
const ENGLISH: &str = "a about above across after again against all almost alone along already also \
although always am among an and another answer any anyone anything are around as ask asked at away \
back be because become been before began begin behind being below best better between big both brief \
but by call called came can cannot case change child children city close come could country course \
data day days did different do does done down during each early end enough even ever every example \
eye eyes face fact family far feel few find first follow following food for form found four free \
friend from full gave general get give given go going good got great group grow had hand hard has \
have he head hear help her here high him his home house how however i idea if important in include \
information into is it its itself just keep kind knew know known large last later learn least leave \
left less let life light like line list little live long look made make man many may me mean means \
might mind model more most mother move much must my name near need never new next night no not \
nothing now number of off often old on once one only open or order other others our out over own \
page paper part people person place plan play point possible power present problem program provide \
put question quick quite rather read real really request result right room run said same saw say \
school second see seem seemed seen set several shall she short should show side since small so some \
someone something sometimes soon start state still story study such sure system take talk tell than \
thank thanks that the their them then there these they thing things think this those though thought \
three through time to today together told too took toward true try turn two under understand until \
up upon us use used user using usually value very want was water way we well went were what when \
where which while who whole why will with within without word words work world would write year \
years yes yet you young your assistant tool tools function token tokens prompt cache router engine \
hello hi please okay ok";

/// Punctuation runs the pre-tokenizer produces for ordinary prose.
const PUNCTUATION: &[&str] = &[
    ".", ",", "!", "?", ":", ";", "'", "\"", "(", ")", "[", "]", "{", "}", "-", "--", "...", "/",
    "\\", "*", "&", "%", "$", "#", "@", "+", "=", "<", ">", "|", "~", "`", "^", ".\"", ",\"",
    "?\"", "!\"", "'.", ").", "),", "):", "%.", "%,",
];

/// The vocabulary in id order.
pub fn vocabulary() -> Vec<String> {
    let mut words: Vec<String> = SPECIAL_TOKENS.iter().map(|s| (*s).to_owned()).collect();
    words.extend((0..NUMBERED_WORDS).map(|n| format!("w{n}")));
    for word in ENGLISH.split_whitespace() {
        words.push(word.to_owned());
        let mut chars = word.chars();
        if let Some(first) = chars.next() {
            let capital: String = first.to_uppercase().chain(chars).collect();
            if capital != word {
                words.push(capital);
            }
        }
    }
    words.extend(PUNCTUATION.iter().map(|p| (*p).to_owned()));
    words.extend((0..=1000).map(|n| n.to_string()));
    let mut seen = std::collections::HashSet::new();
    words.retain(|w| seen.insert(w.clone()));
    words
}

fn build() -> Tokenizer {
    let vocab: HashMap<String, u32> = vocabulary()
        .into_iter()
        .enumerate()
        .map(|(id, word)| (word, id as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token(SPECIAL_TOKENS[0].to_owned())
        .build()
        .unwrap_or_else(|e| unreachable!("a WordLevel model over a fixed vocabulary builds: {e}"));
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Whitespace {}));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    tokenizer
        .add_special_tokens(specials)
        .unwrap_or_else(|e| unreachable!("special tokens of the vocabulary are added: {e}"));
    tokenizer
}

/// The `tokenizer.json` of the word-level tokenizer (deterministic).
pub fn tokenizer_json() -> String {
    build()
        .to_string(false)
        .unwrap_or_else(|e| unreachable!("a WordLevel tokenizer serializes: {e}"))
}

/// Its `tokenizer_config.json`: the chat template and special tokens.
pub fn tokenizer_config_json() -> String {
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_048_576,
        "chat_template": CHAT_TEMPLATE,
    });
    let mut text = serde_json::to_string_pretty(&config)
        .unwrap_or_else(|e| unreachable!("a JSON value serializes: {e}"));
    text.push('\n');
    text
}

/// Both files, ready for [`ModelTokenizer::load`].
pub fn files() -> ModelFiles {
    ModelFiles::from_entries([
        (TOKENIZER_JSON, tokenizer_json().into_bytes()),
        (TOKENIZER_CONFIG_JSON, tokenizer_config_json().into_bytes()),
    ])
}

/// Loads the word-level tokenizer.
///
/// # Errors
///
/// Never in practice; the files are generated (a [`LoadError`] would be a
/// bug).
pub fn load(options: Options) -> Result<ModelTokenizer, LoadError> {
    ModelTokenizer::load(&files(), options)
}

/// A prompt of `n` numbered words starting at `w{first}` (wrapping), which
/// tokenizes to exactly `n` ids.
pub fn numbered_words(first: u32, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        let word = (first as usize + i) % NUMBERED_WORDS as usize;
        out.push('w');
        out.push_str(&word.to_string());
    }
    out
}
