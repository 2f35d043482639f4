//! The Kubernetes access the controller needs.
//!
//! [`REQUIRED`] lists every API call the controller makes (its watches, its
//! status writes, the Recorder's Events, kube-lease-manager's Lease calls).
//! `rbac.yaml` beside this crate's `Cargo.toml` grants them for the Helm
//! chart; a test checks that it grants each of them.

/// Where an access is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// In every watched namespace (a ClusterRole), or cluster-scoped objects.
    Cluster,
    /// In the controller's own namespace only (a Role): the Lease.
    OwnNamespace,
}

/// Verbs on one resource of one API group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// API group (`""` for core).
    pub group: &'static str,
    /// Resource, with `/subresource` when one.
    pub resource: &'static str,
    /// Verbs.
    pub verbs: &'static [&'static str],
    /// Where.
    pub scope: Scope,
}

const READ: &[&str] = &["get", "list", "watch"];

/// Everything the controller calls.
pub const REQUIRED: &[Access] = &[
    Access {
        group: "kinference.buoyant.io",
        resource: "inferenceworkersets",
        verbs: READ,
        scope: Scope::Cluster,
    },
    Access {
        group: "kinference.buoyant.io",
        resource: "inferencepools",
        verbs: READ,
        scope: Scope::Cluster,
    },
    Access {
        group: "kinference.buoyant.io",
        resource: "routingprofiles",
        verbs: READ,
        scope: Scope::Cluster,
    },
    Access {
        group: "kinference.buoyant.io",
        resource: "inferenceworkersets/status",
        verbs: &["patch"],
        scope: Scope::Cluster,
    },
    Access {
        group: "kinference.buoyant.io",
        resource: "inferencepools/status",
        verbs: &["patch"],
        scope: Scope::Cluster,
    },
    Access {
        group: "discovery.k8s.io",
        resource: "endpointslices",
        verbs: READ,
        scope: Scope::Cluster,
    },
    Access {
        group: "events.k8s.io",
        resource: "events",
        verbs: &["create", "patch"],
        scope: Scope::Cluster,
    },
    Access {
        group: "coordination.k8s.io",
        resource: "leases",
        verbs: &["get", "create", "patch"],
        scope: Scope::OwnNamespace,
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn strings(v: &Value) -> Vec<&str> {
        v.as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default()
    }

    #[test]
    fn rbac_yaml_grants_what_the_code_calls() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/rbac.yaml");
        let text = std::fs::read_to_string(path).expect("rbac.yaml beside Cargo.toml");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("rbac.yaml is YAML");
        let rules = |kind: &str| -> Vec<&Value> {
            docs.iter()
                .filter(|d| d["kind"] == kind)
                .flat_map(|d| d["rules"].as_array().into_iter().flatten())
                .collect()
        };
        for access in REQUIRED {
            let kind = match access.scope {
                Scope::Cluster => "ClusterRole",
                Scope::OwnNamespace => "Role",
            };
            for verb in access.verbs {
                let granted = rules(kind).iter().any(|r| {
                    strings(&r["apiGroups"]).contains(&access.group)
                        && strings(&r["resources"]).contains(&access.resource)
                        && strings(&r["verbs"]).contains(verb)
                });
                assert!(
                    granted,
                    "rbac.yaml: no {kind} grants {verb} on {}/{}",
                    access.group, access.resource
                );
            }
        }
        // Nothing beyond what is needed.
        for kind in ["ClusterRole", "Role"] {
            for r in rules(kind) {
                for g in strings(&r["apiGroups"]) {
                    for res in strings(&r["resources"]) {
                        for verb in strings(&r["verbs"]) {
                            assert!(
                                REQUIRED.iter().any(|a| a.group == g
                                    && a.resource == res
                                    && a.verbs.contains(&verb)),
                                "rbac.yaml grants {verb} on {g}/{res}, which the controller does not use"
                            );
                        }
                    }
                }
            }
        }
        // Bindings name the roles.
        for (binding, role) in [
            ("ClusterRoleBinding", "ClusterRole"),
            ("RoleBinding", "Role"),
        ] {
            let b = docs
                .iter()
                .find(|d| d["kind"] == binding)
                .expect("a binding");
            assert_eq!(b["roleRef"]["kind"], role);
        }
    }
}
