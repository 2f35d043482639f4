//! The `kinference-controller` binary as an operator runs it: flags, leader
//! election on a real Lease, the admin endpoints, and a graceful stop on
//! SIGTERM that releases the Lease.

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::coordination::v1::Lease;
use kinference_api::InferenceWorkerSet;
use kinference_examples::cluster;
use kinference_examples::testing::eventually;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const DEADLINE: Duration = Duration::from_secs(90);

async fn get(url: &str) -> Result<(u16, String), String> {
    let client: HttpClient<_, Empty<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    let resp = client
        .get(url.parse().map_err(|e| format!("{e}"))?)
        .await
        .map_err(|e| e.to_string())?;
    let code = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_serves_admin_and_stops_on_sigterm() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-controller-bin").await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        l.local_addr().expect("an address").port()
    };
    let admin = format!("http://127.0.0.1:{port}");

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kinference-controller"))
        .args([
            "--namespace",
            &ns,
            "--lease-namespace",
            &ns,
            "--identity",
            "bin-test",
            "--admin-addr",
            &format!("127.0.0.1:{port}"),
            "--probe-interval",
            "1s",
            "--lease-duration",
            "4s",
            "--lease-grace",
            "1s",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("starting kinference-controller");

    eventually(DEADLINE, "/readyz", || async {
        match get(&format!("{admin}/readyz")).await? {
            (200, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        get(&format!("{admin}/healthz")).await,
        Ok((200, "ok\n".into()))
    );

    let iws: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let ws: InferenceWorkerSet = serde_json::from_value(serde_json::json!({
        "apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferenceWorkerSet",
        "metadata": {"name": "w", "namespace": ns},
        "spec": {"kvBlockSize": 16, "serviceRef": {"name": "svc", "port": "http"}, "profile": "missing"}
    }))
    .expect("a worker set");
    iws.create(&PostParams::default(), &ws)
        .await
        .expect("creating w");
    eventually(DEADLINE, "w's status", || async {
        let w = iws.get("w").await.map_err(|e| e.to_string())?;
        match w.status.map(|s| s.state) {
            Some(s) if s == "UnknownProfile" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let holder = |l: Lease| l.spec.and_then(|s| s.holder_identity);
    assert_eq!(
        holder(
            leases
                .get("kinference-controller")
                .await
                .expect("the Lease")
        ),
        Some("bin-test".into())
    );
    eventually(DEADLINE, "the metrics", || async {
        let (code, metrics) = get(&format!("{admin}/metrics")).await?;
        if code != 200 {
            return Err(format!("status {code}"));
        }
        for line in [
            "kinference_controller_status_writes_total{kind=\"InferenceWorkerSet\"}",
            "kinference_controller_reconciles_total{kind=\"InferenceWorkerSet\"}",
            "kinference_controller_events_total{reason=\"UnknownProfile\",outcome=\"published\"} 1",
            "kinference_controller_leader 1",
        ] {
            if !metrics.contains(line) {
                return Err(format!("{line} not in\n{metrics}"));
            }
        }
        Ok(())
    })
    .await;

    // SIGTERM: a graceful stop that releases the Lease.
    let pid = child.id().expect("running").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("running kill");
    assert!(kill.success());
    let exit = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("the controller stops after SIGTERM")
        .expect("waiting for it");
    assert!(exit.success(), "exit status {exit:?}");
    assert_eq!(
        holder(
            leases
                .get("kinference-controller")
                .await
                .expect("the Lease")
        ),
        None,
        "the Lease is released on stop"
    );

    let dp = DeleteParams::default();
    let lp = ListParams::default();
    let _ = iws.delete_collection(&dp, &lp).await;
    let _ = leases.delete_collection(&dp, &lp).await;
    let _ = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), &ns)
        .delete_collection(&dp, &lp)
        .await;
    cluster::delete_namespace(&client, &ns).await;
}
