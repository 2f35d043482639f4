//! The fast route past the `tokenizers` pipeline gives the pipeline's ids:
//! random text (whitespace runs of every kind, letters, digits,
//! punctuation, contractions, Unicode) through a tokenizer without cache,
//! against `encode_uncached`.

use std::path::PathBuf;
use std::sync::LazyLock;

use kinference_tokenize::{ModelFiles, ModelTokenizer, Options};
use proptest::prelude::*;

fn load(model: &str) -> ModelTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tokenizers")
        .join(model);
    let options = Options {
        cache_bytes: 0,
        ..Options::default()
    };
    ModelTokenizer::load(&ModelFiles::read_dir(dir).unwrap(), options).unwrap()
}

static MODELS: LazyLock<Vec<(&'static str, ModelTokenizer)>> = LazyLock::new(|| {
    ["qwen3", "mistral-nemo-instruct-2407", "gpt2"]
        .into_iter()
        .map(|m| (m, load(m)))
        .collect()
});

#[test]
fn the_real_tokenizers_take_the_fast_route() {
    for (name, tok) in MODELS.iter() {
        assert!(tok.has_fast_path(), "{name}");
    }
}

/// Characters the split regexes treat differently.
fn chunk() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z]{1,8}",
        2 => "[0-9]{1,5}",
        3 => "[ \t\n\r]{1,5}",
        1 => "[\u{a0}\u{2000}\u{2028}\u{3000}\u{85}\u{b}\u{c}]{1,3}",
        2 => "[.,!?;:'\"()\\[\\]{}<>/\\\\@#$%^&*_+=|~`-]{1,4}",
        1 => prop::sample::select(vec!["'s", "'T", "'re", "'VE", "'m", "'LL", "'d", "n't"]).prop_map(str::to_owned),
        1 => "[éüßçøÅ\u{301}\u{308}]{1,3}",
        1 => "[你好世界こんにちは한국어]{1,4}",
        1 => "[😀🍕🚀❤\u{fe0f}\u{200d}]{1,3}",
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(chunk(), 0..24).prop_map(|c| c.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn fast_route_equals_pipeline(text in text()) {
        for (name, tok) in MODELS.iter() {
            for add_special_tokens in [false, true] {
                prop_assert_eq!(
                    tok.encode(&text, add_special_tokens).unwrap(),
                    tok.encode_uncached(&text, add_special_tokens).unwrap(),
                    "{} {:?}", name, text
                );
            }
        }
    }

    #[test]
    fn fast_route_equals_pipeline_on_any_string(text in any::<String>()) {
        for (name, tok) in MODELS.iter() {
            prop_assert_eq!(tok.encode(&text, false).unwrap(), tok.encode_uncached(&text, false).unwrap(), "{} {:?}", name, text);
        }
    }

    /// Text made of random tokens of the model's vocabulary (what the
    /// router's cold-chat bench sends): long pieces, byte tokens that
    /// decode to replacement characters, text out of NFC.
    #[test]
    fn fast_route_equals_pipeline_on_random_tokens(seed in any::<u64>(), len in 1usize..400) {
        for (name, tok) in MODELS.iter() {
            let vocab = u64::try_from(tok.vocab_size()).unwrap();
            let mut x = seed;
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    // SplitMix64.
                    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = x;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    u32::try_from((z ^ (z >> 31)) % vocab).unwrap()
                })
                .collect();
            let text = tok.decode(&ids).unwrap();
            prop_assert_eq!(tok.encode(&text, false).unwrap(), tok.encode_uncached(&text, false).unwrap(), "{} {:?}", name, text);
        }
    }
}
