//! Every case of `testdata/tokenizers/*/vectors.json` (produced with the
//! Python stack vLLM uses) reproduced exactly: completion ids with and
//! without special tokens, chat normalisation (`request` → `render`),
//! rendering (`render` → `prompt`), chat ids, and the expected errors.

use std::path::PathBuf;
use std::sync::LazyLock;

use kinference_tokenize::{
    ChatRequest, Endpoint, Error, ModelFiles, ModelTokenizer, Options, Request,
    TOKENIZER_CONFIG_JSON, TOKENIZER_JSON,
};
use serde_json::{Value, json};

fn model_dir(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tokenizers")
        .join(model)
}

fn vectors(model: &str) -> Value {
    let path = model_dir(model).join("vectors.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the fixture data lives in testdata/)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

fn load(model: &str) -> ModelTokenizer {
    ModelTokenizer::from_dir(model_dir(model)).unwrap_or_else(|e| panic!("loading {model}: {e:#}"))
}

static QWEN3: LazyLock<ModelTokenizer> = LazyLock::new(|| load("qwen3"));
static NEMO: LazyLock<ModelTokenizer> = LazyLock::new(|| load("mistral-nemo-instruct-2407"));
static GPT2: LazyLock<ModelTokenizer> = LazyLock::new(|| load("gpt2"));

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

/// JSON text with key order, so that two values compare order-sensitively
/// (`serde_json`'s `==` on maps ignores order).
fn ordered(v: &Value) -> String {
    serde_json::to_string(v).unwrap()
}

/// Checks every case of one model and returns the failures (all of them,
/// not just the first) and the number of cases checked.
fn check_model(model: &str, tok: &ModelTokenizer) -> (Vec<String>, usize) {
    let v = vectors(model);
    let mut failures = Vec::new();
    let mut checked = 0;

    for (name, meta) in v["files"].as_object().unwrap() {
        let bytes = std::fs::metadata(model_dir(model).join(name))
            .unwrap()
            .len();
        assert_eq!(
            bytes,
            meta["bytes"].as_u64().unwrap(),
            "{model}/{name} differs from the one the vectors were made with"
        );
    }
    if ordered(&Value::Object(tok.special_tokens_map().clone())) != ordered(&v["template_globals"])
    {
        failures.push(format!(
            "template_globals: got {}, want {}",
            ordered(&Value::Object(tok.special_tokens_map().clone())),
            v["template_globals"]
        ));
    }
    assert_eq!(
        tok.has_chat_template(),
        v["has_chat_template"].as_bool().unwrap()
    );

    for case in v["completion_cases"].as_array().unwrap() {
        let id = case["id"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let with = ids(&case["ids_add_special_tokens"]);
        let without = ids(&case["ids_no_special_tokens"]);
        // Twice: cold, then from the segment cache.
        for round in ["cold", "warm"] {
            let got = tok
                .tokenize(Endpoint::Completions, &json!({"prompt": text}))
                .unwrap();
            if got.token_ids != vec![with.clone()] || got.prompt.is_some() {
                failures.push(format!(
                    "completion {id} ({round}): got {:?}, want {with:?}",
                    got.token_ids
                ));
            }
            let got = tok
                .tokenize(
                    Endpoint::Completions,
                    &json!({"prompt": [text, text], "add_special_tokens": false}),
                )
                .unwrap();
            if got.token_ids != vec![without.clone(), without.clone()] {
                failures.push(format!(
                    "completion {id} without special tokens ({round}): got {:?}, want {without:?}",
                    got.token_ids
                ));
            }
            let got = tok
                .tokenize(Endpoint::Tokenize, &json!({"prompt": text}))
                .unwrap();
            if got.token_ids != vec![with.clone()] {
                failures.push(format!("/tokenize {id} ({round}): got {:?}", got.token_ids));
            }
        }
        if tok.encode_uncached(text, true).unwrap() != with
            || tok.encode_uncached(text, false).unwrap() != without
        {
            failures.push(format!("completion {id}: the uncached pipeline differs"));
        }
        // Token ids pass through unchanged.
        if !with.is_empty() {
            let got = tok
                .tokenize_request(&json!({"prompt": with.clone()}))
                .unwrap();
            if got.token_ids != vec![with.clone()] {
                failures.push(format!(
                    "completion {id}: token ids were not passed through"
                ));
            }
        }
        checked += 1;
    }

    for case in v["chat_cases"].as_array().unwrap() {
        let id = case["id"].as_str().unwrap();
        let request = &case["request"];
        let render = &case["render"];
        let chat = ChatRequest::parse(Endpoint::ChatCompletions, request).unwrap();

        // Stage 1: vLLM's normalisation.
        if tok.has_chat_template() {
            let inputs = tok.render_inputs(&chat).unwrap();
            let got = json!({
                "messages": inputs.messages,
                "tools": inputs.tools,
                "add_generation_prompt": inputs.add_generation_prompt,
                "continue_final_message": inputs.continue_final_message,
                "template_kwargs": inputs.template_kwargs,
            });
            if ordered(&got) != ordered(render) {
                failures.push(format!(
                    "chat {id}: render inputs\n  got  {}\n  want {}",
                    ordered(&got),
                    ordered(render)
                ));
            }
        }

        // Stage 2 and ids, through every entry point.
        let results = [
            ("chat", tok.tokenize(Endpoint::ChatCompletions, request)),
            ("detect", tok.tokenize_request(request)),
            (
                "bytes",
                tok.tokenize_bytes(None, request.to_string().as_bytes()),
            ),
            ("chat warm", tok.tokenize_chat(&chat)),
            ("/tokenize", tok.tokenize(Endpoint::Tokenize, request)),
        ];
        for (path, result) in results {
            match (&case.get("error"), result) {
                (Some(want), Err(err)) => {
                    let want = want.as_str().unwrap();
                    if err.to_string() != want || !err.is_client_error() {
                        failures.push(format!("chat {id} ({path}): error {err:?}, want {want:?}"));
                    }
                    let kind_ok = if tok.has_chat_template() {
                        matches!(err, Error::TemplateRaised(_))
                    } else {
                        matches!(err, Error::NoChatTemplate)
                    };
                    if !kind_ok {
                        failures.push(format!("chat {id} ({path}): error variant {err:?}"));
                    }
                }
                (Some(want), Ok(got)) => {
                    failures.push(format!(
                        "chat {id} ({path}): rendered {:?}, want error {want}",
                        got.prompt
                    ));
                }
                (None, Err(err)) => failures.push(format!("chat {id} ({path}): {err}")),
                (None, Ok(got)) => {
                    let want_prompt = case["prompt"].as_str().unwrap();
                    if got.prompt.as_deref() != Some(want_prompt) {
                        failures.push(format!(
                            "chat {id} ({path}): prompt\n  got  {:?}\n  want {want_prompt:?}",
                            got.prompt
                        ));
                    }
                    if got.token_ids != vec![ids(&case["ids"])] {
                        failures.push(format!(
                            "chat {id} ({path}): ids\n  got  {:?}\n  want {:?}",
                            got.token_ids, case["ids"]
                        ));
                    }
                }
            }
        }
        if case.get("error").is_none() {
            let mut body = request.clone();
            body["add_special_tokens"] = json!(true);
            let got = tok.tokenize(Endpoint::ChatCompletions, &body).unwrap();
            if got.token_ids != vec![ids(&case["ids_add_special_tokens"])] {
                failures.push(format!(
                    "chat {id} with add_special_tokens: got {:?}",
                    got.token_ids
                ));
            }
            let prompt = case["prompt"].as_str().unwrap();
            if tok.encode_uncached(prompt, false).unwrap() != ids(&case["ids"]) {
                failures.push(format!("chat {id}: uncached ids differ"));
            }
        }
        checked += 1;
    }
    (failures, checked)
}

fn assert_model(model: &str, tok: &ModelTokenizer) {
    let v = vectors(model);
    let total =
        v["completion_cases"].as_array().unwrap().len() + v["chat_cases"].as_array().unwrap().len();
    let (failures, checked) = check_model(model, tok);
    assert_eq!(checked, total, "every case is checked");
    assert!(total > 30, "{model}: only {total} cases found");
    assert!(
        failures.is_empty(),
        "{model}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let stats = tok.cache_stats();
    assert!(stats.hits > 0 && stats.misses > 0, "{stats:?}");
}

#[test]
fn qwen3_vectors() {
    assert_model("qwen3", &QWEN3);
}

#[test]
fn mistral_nemo_vectors() {
    assert_model("mistral-nemo-instruct-2407", &NEMO);
}

#[test]
fn gpt2_vectors() {
    assert_model("gpt2", &GPT2);
}

#[test]
fn mistral_bos_comes_from_the_post_processor() {
    assert_eq!(NEMO.bos_token_id(), Some(1));
    assert_eq!(NEMO.eos_token_id(), Some(2));
    assert_eq!(NEMO.encode("", true).unwrap(), vec![1]);
    assert_eq!(NEMO.encode("", false).unwrap(), Vec::<u32>::new());
    assert_eq!(QWEN3.eos_token_id(), Some(151_645));
    assert_eq!(QWEN3.bos_token_id(), None);
}

#[test]
fn loads_from_configmap_entries() {
    let dir = model_dir("gpt2");
    let files = ModelFiles::from_entries(
        [TOKENIZER_JSON, TOKENIZER_CONFIG_JSON]
            .map(|name| (name, std::fs::read(dir.join(name)).unwrap())),
    );
    let tok = ModelTokenizer::load(&files, Options::default()).unwrap();
    assert_eq!(
        tok.encode("Hello, world!", true).unwrap(),
        vec![15496, 11, 995, 0]
    );
    assert_eq!(tok.model_max_length(), Some(1024));
    assert_eq!(tok.vocab_size(), 50257);
}

#[test]
fn uncached_tokenizer_gives_the_same_ids() {
    let tok = ModelTokenizer::load(
        &ModelFiles::read_dir(model_dir("gpt2")).unwrap(),
        Options {
            cache_bytes: 0,
            ..Options::default()
        },
    )
    .unwrap();
    let (failures, _) = check_model("gpt2", &tok);
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(tok.cache_stats().hits + tok.cache_stats().misses, 0);
}

#[test]
fn decode_and_token_strs() {
    assert_eq!(GPT2.decode(&[15496, 11, 995, 0]).unwrap(), "Hello, world!");
    // gpt2 cleans up tokenization spaces (its config says so).
    let ids = GPT2.encode("a . b", false).unwrap();
    assert_eq!(GPT2.decode(&ids).unwrap(), "a. b");
    let ids = QWEN3.encode("a . b<|im_end|>", false).unwrap();
    assert_eq!(QWEN3.decode(&ids).unwrap(), "a . b<|im_end|>");
    assert_eq!(
        GPT2.token_strs(&[15496, 11, 99_999_999]),
        vec![Some("Hello".to_string()), Some(",".to_string()), None]
    );
}

#[test]
fn truncate_prompt_tokens_keeps_the_tail() {
    let got = GPT2
        .tokenize(
            Endpoint::Completions,
            &json!({"prompt": "Hello, world!", "truncate_prompt_tokens": 2}),
        )
        .unwrap();
    assert_eq!(got.token_ids, vec![vec![995, 0]]);
    let got = GPT2
        .tokenize(
            Endpoint::Completions,
            &json!({"prompt": [1, 2, 3], "truncate_prompt_tokens": 5}),
        )
        .unwrap();
    assert_eq!(got.token_ids, vec![vec![1, 2, 3]]);
}

#[test]
fn request_templates_need_trust() {
    let body = json!({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages[0].content }}!"});
    assert!(matches!(
        QWEN3.tokenize_request(&body),
        Err(Error::UntrustedChatTemplate)
    ));
    let trusting = ModelTokenizer::load(
        &ModelFiles::read_dir(model_dir("gpt2")).unwrap(),
        Options {
            trust_request_chat_template: true,
            ..Options::default()
        },
    )
    .unwrap();
    let got = trusting.tokenize_request(&body).unwrap();
    assert_eq!(got.prompt.as_deref(), Some("x!"));
    let broken = json!({"messages": [], "chat_template": "{% if %}"});
    assert!(matches!(
        trusting.tokenize_request(&broken),
        Err(Error::Template(_))
    ));
}

#[test]
fn malformed_requests_are_errors_not_panics() {
    for body in [
        json!(null),
        json!("x"),
        json!({}),
        json!({"messages": "hi"}),
        json!({"messages": [{"role": 1}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        json!({"prompt": {"a": 1}}),
        json!({"prompt": [1.5]}),
    ] {
        let err = QWEN3.tokenize_request(&body).unwrap_err();
        assert!(err.is_client_error(), "{body}: {err}");
    }
    assert!(matches!(
        QWEN3.tokenize_bytes(None, b"{not json"),
        Err(Error::InvalidRequest(_))
    ));
    // An empty conversation: the template itself fails.
    assert!(matches!(
        QWEN3.tokenize_request(&json!({"messages": []})),
        Err(Error::Template(_))
    ));
}

#[test]
fn parsed_requests_round_trip() {
    let body =
        json!({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false});
    let Request::Chat(chat) = Request::detect(&body).unwrap() else {
        panic!("chat expected");
    };
    let a = QWEN3.tokenize_chat(&chat).unwrap();
    let b = QWEN3.tokenize_request(&body).unwrap();
    assert_eq!((&a.prompt, &a.token_ids), (&b.prompt, &b.token_ids));
    assert_eq!(
        b.cached_tokens,
        b.total_tokens(),
        "the second time comes from the cache"
    );
    assert_eq!(
        a.prompt.as_deref(),
        Some("<|im_start|>user\nHi<|im_end|>\n")
    );
}

#[test]
fn loading_errors_say_which_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelTokenizer::from_dir(dir.path()).unwrap_err();
    assert_eq!(err.to_string(), "tokenizer.json is missing");
    std::fs::write(dir.path().join(TOKENIZER_JSON), "{}").unwrap();
    let err = ModelTokenizer::from_dir(dir.path()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("tokenizer.json is not a usable tokenizer"),
        "{err}"
    );
    std::fs::write(
        dir.path().join(TOKENIZER_JSON),
        std::fs::read(model_dir("gpt2").join(TOKENIZER_JSON)).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join(TOKENIZER_CONFIG_JSON),
        r#"{"chat_template": "{% for %}"}"#,
    )
    .unwrap();
    let err = ModelTokenizer::from_dir(dir.path()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tokenizer_config.json: chat template `default` does not compile"
    );
    std::fs::write(dir.path().join(TOKENIZER_CONFIG_JSON), "[]").unwrap();
    let err = ModelTokenizer::from_dir(dir.path()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tokenizer_config.json: `(top level)` must be a JSON object"
    );
}

#[test]
fn shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<ModelTokenizer>();
    let tok = std::sync::Arc::new(load("gpt2"));
    let want = tok
        .encode_uncached("Hello<|endoftext|>World", true)
        .unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let tok = tok.clone();
            std::thread::spawn(move || tok.encode("Hello<|endoftext|>World", true).unwrap())
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), want);
    }
}
