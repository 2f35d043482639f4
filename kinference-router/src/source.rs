//! Sources of truth that feed the [`Catalog`]: Kubernetes watches, or a
//! directory of the same YAML objects.
//!
//! Both end in the catalog's `apply` / `delete` / `reset` calls, so the data
//! plane cannot tell them apart.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kinference_api::manifests::{self, Object};
use kinference_api::{InferencePool, InferenceWorkerSet, RoutingProfile};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::catalog::{Catalog, Kind};

/// The catalog, shared by the tasks that feed it.
pub type SharedCatalog = Arc<Mutex<Catalog>>;

/// Why a manifests directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ManifestsError {
    /// The directory or a file could not be read.
    #[error("reading {path}")]
    Read {
        /// What was being read.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A file holds an invalid object.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        #[source]
        source: manifests::ManifestError,
    },
}

/// The objects of a manifests directory, by kind.
#[derive(Debug, Default)]
pub struct Manifests {
    /// Pools.
    pub pools: Vec<InferencePool>,
    /// Worker sets.
    pub worker_sets: Vec<InferenceWorkerSet>,
    /// Profiles.
    pub profiles: Vec<RoutingProfile>,
    /// EndpointSlices.
    pub slices: Vec<EndpointSlice>,
    /// Objects of other kinds, as `Kind/name`, ignored.
    pub ignored: Vec<String>,
}

impl Manifests {
    /// Adds `o`, read from a file in `base` (a relative tokenizer path is
    /// relative to it).
    fn push(&mut self, o: Object, base: &Path) {
        match o {
            Object::Pool(o) => self.pools.push(*o),
            Object::WorkerSet(o) => self.worker_sets.push(*o),
            Object::Profile(mut o) => {
                if let Some(p) = o
                    .spec
                    .tokenization
                    .tokenizer
                    .as_mut()
                    .and_then(|t| t.path.as_mut())
                    && Path::new(p.as_str()).is_relative()
                {
                    *p = base.join(p.as_str()).display().to_string();
                }
                self.profiles.push(*o);
            }
            Object::EndpointSlice(o) => self.slices.push(*o),
            other @ Object::Other { .. } => self.ignored.push(other.describe()),
        }
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), ManifestsError> {
    let read_err = |source| ManifestsError::Read {
        path: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let path = entry.map_err(read_err)?.path();
        if path.is_dir() {
            yaml_files(&path, out)?;
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
        {
            out.push(path);
        }
    }
    Ok(())
}

/// The files a load reads and what they looked like, to notice changes.
fn fingerprint(dir: &Path) -> Result<Vec<(PathBuf, Option<SystemTime>, u64)>, ManifestsError> {
    let mut files = Vec::new();
    yaml_files(dir, &mut files)?;
    files.sort();
    Ok(files
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            let mtime = meta.as_ref().and_then(|m| m.modified().ok());
            let len = meta.map_or(0, |m| m.len());
            (p, mtime, len)
        })
        .collect())
}

/// Reads every `*.yaml`/`*.yml` file under `dir` (recursively).
///
/// # Errors
/// The first unreadable file or invalid object; nothing is returned then, so
/// a caller keeps its last good state.
pub fn load_manifests(dir: &Path) -> Result<Manifests, ManifestsError> {
    let mut files = Vec::new();
    yaml_files(dir, &mut files)?;
    files.sort();
    let mut out = Manifests::default();
    for path in files {
        let text = std::fs::read_to_string(&path).map_err(|source| ManifestsError::Read {
            path: path.clone(),
            source,
        })?;
        let objects = manifests::parse(&text).map_err(|source| ManifestsError::Invalid {
            path: path.clone(),
            source,
        })?;
        let base = path.parent().unwrap_or(dir);
        for o in objects {
            out.push(o, base);
        }
    }
    Ok(out)
}

/// Replaces the whole catalog with a directory's objects.
pub fn reset_from(catalog: &mut Catalog, m: Manifests) {
    catalog.reset_pools(m.pools);
    catalog.reset_worker_sets(m.worker_sets);
    catalog.reset_profiles(m.profiles);
    catalog.reset_slices(m.slices);
}

/// The pool the quick mode (`--engine URL`) serves.
pub const QUICK_POOL: &str = "default/quick";

/// The objects of the quick mode: a pool `quick` with one worker set
/// `engines` (built-in `default` profile, block width `kv_block_size`, KV
/// events on `kv_port` unless the engines say otherwise) whose ready
/// endpoints are `engines` (`http://host:port` each), checked as any
/// manifest is.
///
/// # Errors
/// An engine that is not an `http://host:port` URL.
pub fn quick_objects(
    engines: &[String],
    kv_port: u16,
    kv_block_size: u32,
) -> Result<Manifests, String> {
    use std::fmt::Write as _;
    let mut yaml = String::from(
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferencePool\nmetadata: {name: quick, namespace: default}\nspec: {workerSets: [{name: engines}]}\n---\n",
    );
    let _ = write!(
        yaml,
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: engines, namespace: default}}\nspec:\n  profile: default\n  kvBlockSize: {kv_block_size}\n  serviceRef: {{name: engines, port: http}}\n  kvEvents: {{port: kv}}\n---\n"
    );
    for (i, url) in engines.iter().enumerate() {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("--engine {url:?}: not a URL: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "--engine {url:?}: write it as http://HOST:PORT (engines speak plain HTTP)"
            ));
        }
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| format!("--engine {url:?}: no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(80);
        let kind = if host.parse::<std::net::Ipv6Addr>().is_ok() {
            "IPv6"
        } else if host.parse::<std::net::Ipv4Addr>().is_ok() {
            "IPv4"
        } else {
            "FQDN"
        };
        let kv = format!(", {{name: kv, port: {kv_port}}}");
        let _ = write!(
            yaml,
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: engine-{i}\n  namespace: default\n  labels: {{kubernetes.io/service-name: engines}}\naddressType: {kind}\nports: [{{name: http, port: {port}}}{kv}]\nendpoints:\n  - addresses: [\"{host}\"]\n    conditions: {{ready: true}}\n---\n"
        );
    }
    let mut out = Manifests::default();
    for o in manifests::parse(&yaml).map_err(|e| e.to_string())? {
        out.push(o, Path::new("."));
    }
    Ok(out)
}

/// Loads `dir` into the catalog now, then reloads it whenever its files
/// change (checked every `interval`) until `stop`. A reload that fails keeps
/// the last good objects and logs why.
///
/// # Errors
/// When the first load fails: a router must not start on a directory it
/// cannot read.
pub async fn watch_manifests(
    dir: PathBuf,
    catalog: SharedCatalog,
    interval: Duration,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, ManifestsError> {
    let d = dir.clone();
    let (first, print) = tokio::task::spawn_blocking(move || {
        Ok::<_, ManifestsError>((load_manifests(&d)?, fingerprint(&d)?))
    })
    .await
    .expect("manifest loading does not panic")?;
    if !first.ignored.is_empty() {
        tracing::info!(dir = %dir.display(), ignored = ?first.ignored, "objects of other kinds are ignored");
    }
    reset_from(&mut *catalog.lock().await, first);
    tracing::info!(dir = %dir.display(), "manifests loaded");
    Ok(tokio::spawn(async move {
        let mut last = print;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let d = dir.clone();
            let seen = last.clone();
            let reload =
                tokio::task::spawn_blocking(move || -> Result<Option<_>, ManifestsError> {
                    let now = fingerprint(&d)?;
                    if now == seen {
                        return Ok(None);
                    }
                    Ok(Some((load_manifests(&d)?, now)))
                });
            match reload.await.expect("manifest loading does not panic") {
                Ok(None) => {}
                Ok(Some((m, now))) => {
                    // Remember the new state only once it loaded, so a broken
                    // file is retried until it is fixed.
                    last = now;
                    reset_from(&mut *catalog.lock().await, m);
                    tracing::info!(dir = %dir.display(), "manifests reloaded");
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "manifests not reloaded; keeping the last good objects");
                    // Avoid logging the same error every interval.
                    if let Ok(now) = fingerprint(&dir) {
                        last = now;
                    }
                }
            }
        }
    }))
}

/// Watches the pool's objects on a Kubernetes API server until `stop`: the
/// pool's namespace for pools, worker sets and EndpointSlices (those with a
/// `kubernetes.io/service-name` label), and every RoutingProfile.
pub fn watch_kubernetes(
    client: &Client,
    catalog: &SharedCatalog,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let ns = {
        // The pool never changes; reading it without awaiting the lock keeps
        // this function synchronous.
        let c = catalog
            .try_lock()
            .expect("the catalog is not in use at start-up");
        c.pool().namespace.clone()
    };
    let slice_cfg =
        watcher::Config::default().labels(kinference_api::endpoints::SERVICE_NAME_LABEL);
    vec![
        spawn_watch(
            Api::<InferencePool>::namespaced(client.clone(), &ns),
            watcher::Config::default(),
            Kind::Pool,
            catalog.clone(),
            stop.clone(),
        ),
        spawn_watch(
            Api::<InferenceWorkerSet>::namespaced(client.clone(), &ns),
            watcher::Config::default(),
            Kind::WorkerSet,
            catalog.clone(),
            stop.clone(),
        ),
        spawn_watch(
            Api::<RoutingProfile>::all(client.clone()),
            watcher::Config::default(),
            Kind::Profile,
            catalog.clone(),
            stop.clone(),
        ),
        spawn_watch(
            Api::<EndpointSlice>::namespaced(client.clone(), &ns),
            slice_cfg,
            Kind::EndpointSlice,
            catalog.clone(),
            stop.clone(),
        ),
    ]
}

/// Objects the catalog can take, by kind.
trait Catalogued:
    Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static
{
    fn apply(self, c: &mut Catalog);
    fn delete(name: &str, c: &mut Catalog);
    fn reset(all: Vec<Self>, c: &mut Catalog);
}

macro_rules! catalogued {
    ($t:ty, $apply:ident, $delete:ident, $reset:ident) => {
        impl Catalogued for $t {
            fn apply(self, c: &mut Catalog) {
                c.$apply(self);
            }
            fn delete(name: &str, c: &mut Catalog) {
                c.$delete(name);
            }
            fn reset(all: Vec<Self>, c: &mut Catalog) {
                c.$reset(all);
            }
        }
    };
}
catalogued!(InferencePool, apply_pool, delete_pool, reset_pools);
catalogued!(
    InferenceWorkerSet,
    apply_worker_set,
    delete_worker_set,
    reset_worker_sets
);
catalogued!(
    RoutingProfile,
    apply_profile,
    delete_profile,
    reset_profiles
);
catalogued!(EndpointSlice, apply_slice, delete_slice, reset_slices);

fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    catalog: SharedCatalog,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()>
where
    K: Catalogued,
    K::DynamicType: Default,
{
    tokio::spawn(async move {
        let stream = watcher::watcher(api, config).default_backoff();
        futures::pin_mut!(stream);
        let mut relist: Vec<K> = Vec::new();
        loop {
            let next = tokio::select! {
                () = stop.cancelled() => return,
                n = stream.next() => n,
            };
            let Some(event) = next else { return };
            match event {
                Ok(Event::Init) => relist.clear(),
                Ok(Event::InitApply(o)) => relist.push(o),
                Ok(Event::InitDone) => {
                    let all = std::mem::take(&mut relist);
                    tracing::debug!(?kind, objects = all.len(), "listed");
                    K::reset(all, &mut *catalog.lock().await);
                }
                Ok(Event::Apply(o)) => o.apply(&mut *catalog.lock().await),
                Ok(Event::Delete(o)) => K::delete(&o.name_any(), &mut *catalog.lock().await),
                Err(e) => tracing::warn!(?kind, error = %e, "watch failed; retrying with backoff"),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    #[test]
    fn quick_objects_name_each_engine() {
        let m = quick_objects(
            &[
                "http://10.0.0.5:8000".into(),
                "http://[fd00::7]:8001".into(),
                "http://vllm-0.vllm:8000".into(),
            ],
            5557,
            32,
        )
        .unwrap();
        assert_eq!(m.pools.len(), 1);
        assert_eq!(m.pools[0].name_any(), "quick");
        assert_eq!(m.worker_sets[0].spec.kv_block_size, 32);
        let e = kinference_api::endpoints::read(
            &m.slices,
            &IntOrString::String("http".into()),
            Some(&IntOrString::String("kv".into())),
            None,
        );
        let got: Vec<(&str, u16, Option<u16>)> = e
            .ready
            .iter()
            .map(|r| (r.address.as_str(), r.http_port, r.kv_port))
            .collect();
        assert_eq!(
            got,
            [
                ("10.0.0.5", 8000, Some(5557)),
                ("fd00::7", 8001, Some(5557)),
                ("vllm-0.vllm", 8000, Some(5557))
            ]
        );
        for bad in ["https://e:1", "not a url", "http://:80", "10.0.0.5:8000"] {
            assert!(quick_objects(&[bad.into()], 5557, 16).is_err(), "{bad}");
        }
    }
}
