//! `cargo xtask demo`: what kinference can show today.
//!
//! Until the router lands, the demo shows the API: the CRDs are generated and
//! current, the seed's objects validate, invalid ones are refused with their
//! messages, and (when `KUBECONFIG` names a server) the objects are applied
//! to a real API server and listed with kubectl.

use std::process::ExitCode;

use anyhow::{Context, Result};
use kinference_api::manifests::{self, Object};
use kinference_examples::cluster;

pub(crate) fn run() -> Result<ExitCode> {
    println!(
        "== kinference demo (API only: the router and simulated engines are not built yet) ==\n"
    );
    let root = crate::workspace_root();
    if crate::gen_crds::run(&root, true)? != ExitCode::SUCCESS {
        anyhow::bail!("the CRDs in deploy/crds are stale");
    }

    println!("\n-- the seed's objects, validated with the CRDs' own CEL rules --");
    let mut objects = Vec::new();
    for (file, text) in kinference_examples::yaml_files(&kinference_examples::manifests_dir()) {
        for o in manifests::parse(&text).with_context(|| format!("examples/manifests/{file}"))? {
            println!("  ok       {file}: {}", o.describe());
            objects.push(o);
        }
    }
    println!("\n-- invalid objects, refused with these messages --");
    for case in kinference_examples::invalid_examples() {
        match manifests::parse(&case.text) {
            Ok(_) => anyhow::bail!("examples/invalid/{} was accepted", case.file),
            Err(e) => println!("  refused  {}: {e}", case.file),
        }
    }

    if std::env::var_os("KUBECONFIG").is_none() {
        println!(
            "\nKUBECONFIG is not set, so nothing was applied to a cluster.\n{}",
            cluster::ADVICE
        );
        return Ok(ExitCode::SUCCESS);
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(apply(objects))?;
    Ok(ExitCode::SUCCESS)
}

async fn apply(objects: Vec<Object>) -> Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let ns = "kinference-demo";
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    println!("\n-- applied to the API server in KUBECONFIG (namespace {ns}) --");
    let pp = PatchParams::apply("kinference-demo").force();
    for o in objects {
        match o {
            Object::WorkerSet(mut o) => {
                o.metadata.namespace = Some(ns.into());
                let name = o.metadata.name.clone().unwrap_or_default();
                let api: Api<kinference_api::InferenceWorkerSet> =
                    Api::namespaced(client.clone(), ns);
                api.patch(&name, &pp, &Patch::Apply(&*o)).await?;
            }
            Object::Pool(mut o) => {
                o.metadata.namespace = Some(ns.into());
                let name = o.metadata.name.clone().unwrap_or_default();
                let api: Api<kinference_api::InferencePool> = Api::namespaced(client.clone(), ns);
                api.patch(&name, &pp, &Patch::Apply(&*o)).await?;
            }
            Object::Profile(o) => {
                let name = o.metadata.name.clone().unwrap_or_default();
                let api: Api<kinference_api::RoutingProfile> = Api::all(client.clone());
                api.patch(&name, &pp, &Patch::Apply(&*o)).await?;
            }
            Object::EndpointSlice(_) | Object::Other { .. } => {}
        }
    }
    print!("{}", cluster::kubectl_run(&["get", "iws,ipool", "-n", ns]));
    print!("{}", cluster::kubectl_run(&["get", "routingprofiles"]));
    println!("\n(READY and STATE stay empty until the controller runs: not built yet.)");
    Ok(())
}
