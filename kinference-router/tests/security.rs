//! Client API keys, the engines' own API key, and TLS on the serving port,
//! with the `openai` Python client as users run it (needs `pip install
//! openai` and the `openssl` command to make a test certificate).

mod support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use support::*;

const CLIENT: &str = r#"
import json, sys
import openai

base, model, cert, key = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
# The client's own HTTP client, trusting the test's certificate.
http = openai.DefaultHttpxClient(verify=cert)
c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, http_client=http)
out = {"models": sorted(m.id for m in c.models.list().data)}
r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=3)
out["chat"] = r.usage.completion_tokens
chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "w4"}],
                                        max_tokens=4, stream=True))
out["stream"] = len([ch for ch in chunks if ch.choices])
wrong = openai.OpenAI(base_url=base + "/v1", api_key="not-a-key", max_retries=0, http_client=http)
try:
    wrong.models.list()
    out["wrong_key"] = None
except openai.AuthenticationError as e:
    out["wrong_key"] = {"status": e.status_code, "code": e.code}
out["health"] = http.get(base + "/health").status_code
print(json.dumps(out))
"#;

/// A self-signed certificate for 127.0.0.1 in `dir`.
fn certificate(dir: &Path) -> (String, String) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let out = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=kinference-test"])
        .args(["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap_or_else(|e| {
            panic!("this test needs the openssl command ({e}): apt-get install openssl")
        });
    assert!(
        out.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert.display().to_string(), key.display().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_need_a_key_engines_get_theirs_over_tls() {
    // Engines started with --api-key: discovery, probes and requests all
    // need it, and a client's key would be refused.
    let sims = engines(2, |c| c.api_key = Some("engine-secret".into())).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let secrets = tempfile::tempdir().unwrap();
    let keys = secrets.path().join("keys");
    std::fs::write(&keys, "# the team's keys\nclient-key-1\nclient-key-2\n").unwrap();
    let (cert, key) = certificate(secrets.path());
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &[
            "--api-keys-file",
            keys.to_str().unwrap(),
            "--engine-api-key",
            "engine-secret",
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
        ],
    )
    .await;
    // The engines' models were discovered with the engines' key, and the
    // speed probes went with it.
    wait_routable(&r, 2, true).await;
    let m = get(r.admin(), "/metrics").await.text();
    assert_eq!(speed_probes(&m, "ok"), 2, "{m}");

    let base = format!("https://{}", r.api());
    let v = openai_python(CLIENT, &[&base, MODEL, &cert, "client-key-2"]).await;
    assert_eq!(v["models"], serde_json::json!([MODEL, ALIAS]));
    assert_eq!(v["chat"], 3);
    assert!(v["stream"].as_u64().unwrap() >= 3, "{v}");
    assert_eq!(v["wrong_key"]["status"], 401);
    assert_eq!(v["wrong_key"]["code"], "invalid_api_key");
    assert_eq!(v["health"], 200);
    // Plain HTTP on a TLS port gets nothing served.
    let plain = tokio::time::timeout(
        Duration::from_secs(5),
        support::client().request(
            http::Request::get(format!("http://{}/v1/models", r.api()))
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap(),
        ),
    )
    .await;
    assert!(
        !matches!(plain, Ok(Ok(ref resp)) if resp.status().is_success()),
        "plain HTTP was served on the TLS port"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_keys_file_takes_effect_without_a_restart() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let secrets = tempfile::tempdir().unwrap();
    let keys = secrets.path().join("keys");
    std::fs::write(&keys, "old-key\n").unwrap();
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &["--api-keys-file", keys.to_str().unwrap()],
    )
    .await;
    wait_routable(&r, 1, true).await;
    let body = Bytes::from(serde_json::to_vec(&chat(MODEL, "w1 w2", false, 2)).unwrap());
    let call = |key: &'static str| {
        let body = body.clone();
        let api = r.api();
        async move {
            let auth = format!("Bearer {key}");
            send(
                api,
                "POST",
                "/v1/chat/completions",
                &[("authorization", &auth)],
                body,
            )
            .await
            .status
        }
    };
    assert_eq!(call("old-key").await, 200);
    assert_eq!(call("new-key").await, 401);
    let anonymous = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, "w1", false, 1),
    )
    .await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(anonymous.json()["error"]["code"], "invalid_api_key");
    // Anthropic's clients send x-api-key.
    let anthropic = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-api-key", "old-key")],
        body.clone(),
    )
    .await;
    assert_eq!(anthropic.status, 200);
    assert_eq!(get(r.api(), "/health").await.status, 200);

    // A Secret's new content, as the kubelet writes it.
    let tmp = secrets.path().join(".keys.tmp");
    std::fs::write(&tmp, "new-key\n").unwrap();
    std::fs::rename(&tmp, &keys).unwrap();
    eventually(
        Duration::from_secs(20),
        "the new key is accepted",
        || async { (call("new-key").await == 200).then_some(()) },
    )
    .await;
    assert_eq!(call("old-key").await, 401);
    // An emptied file keeps the keys in force rather than locking all out
    // or letting everyone in.
    std::fs::write(&keys, "").unwrap();
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(call("new-key").await, 200);
    r.shutdown().await;
}
