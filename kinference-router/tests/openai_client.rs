//! The `openai` Python package, unchanged, talks to engines through the
//! router: chat and completions, streaming and not, the model list, an alias
//! and an unknown model. Fails with advice when the package is missing
//! (`pip install openai`).

mod support;

use serde_json::Value;
use support::*;

const CLIENT: &str = r#"
import json, sys
import openai

base, model, alias = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {"models": sorted(m.id for m in c.models.list().data)}

r = c.completions.create(model=model, prompt="w1 w2 w3 w4 w5", max_tokens=5)
out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                     "completion_tokens": r.usage.completion_tokens}

chunks = list(c.completions.create(model=model, prompt="w1 w2 w3", max_tokens=4, stream=True,
                                   stream_options={"include_usage": True}))
out["completion_stream"] = {"texts": [ch.choices[0].text for ch in chunks if ch.choices],
                            "completion_tokens": chunks[-1].usage.completion_tokens}

messages = [{"role": "system", "content": "w7 w8 w9"}, {"role": "user", "content": "w10 w11"}]
raw = c.chat.completions.with_raw_response.create(model=alias, messages=messages, max_completion_tokens=3)
r = raw.parse()
out["chat"] = {"content": r.choices[0].message.content, "role": r.choices[0].message.role,
               "model": r.model, "endpoint": raw.headers.get("x-kinference-endpoint")}

chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=3, stream=True))
out["chat_stream"] = {"deltas": [ch.choices[0].delta.content for ch in chunks if ch.choices]}

try:
    c.chat.completions.create(model="no-such-model", messages=messages, max_tokens=1)
    out["not_found"] = None
except openai.NotFoundError as e:
    out["not_found"] = {"status": e.status_code, "code": e.code}
print(json.dumps(out))
"#;

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_the_router() {
    let check = std::process::Command::new(python())
        .args(["-c", "import openai"])
        .output();
    match check {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "this test needs the `openai` Python package: pip install openai ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => {
            panic!("this test needs python3 with the `openai` package ({e}): pip install openai")
        }
    }
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;

    let base = format!("http://{}", r.api());
    let out = tokio::process::Command::new(python())
        .args(["-c", CLIENT, &base, MODEL, ALIAS])
        .output()
        .await
        .expect("run python");
    assert!(
        out.status.success(),
        "python client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("client prints JSON");
    eprintln!("{v:#}");
    assert_eq!(v["models"], serde_json::json!([MODEL, ALIAS]));
    assert_eq!(v["completion"]["completion_tokens"], 5);
    assert!(!v["completion"]["text"].as_str().unwrap().is_empty());
    assert_eq!(v["completion_stream"]["completion_tokens"], 4);
    assert!(
        !v["completion_stream"]["texts"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(v["chat"]["role"], "assistant");
    assert_eq!(
        v["chat"]["model"], MODEL,
        "the alias was rewritten to the served name"
    );
    let ep = v["chat"]["endpoint"].as_str().unwrap();
    assert!(sims.iter().any(|s| s.http_addr().to_string() == ep));
    assert!(v["chat_stream"]["deltas"].as_array().unwrap().len() >= 3);
    assert_eq!(v["not_found"]["status"], 404);
    assert_eq!(v["not_found"]["code"], "model_not_found");
    r.shutdown().await;
}
