//! Names claimed by two worker sets of a pool: one rule for the controller
//! (which rejects the newer set with `AliasConflict`) and the router (which
//! then does not route to it).
//!
//! A worker set *claims* each model name it offers (`spec.models`, then the
//! models its status reports) and each alias (meaning the model it is
//! listed under). Sets are taken oldest first (`creationTimestamp`, then
//! name); one that claims a name an admitted set of a shared pool already
//! claims *for another model* is rejected, and the older keeps the name.
//! Two sets claiming a name with the same meaning (two sets serving one
//! model) do not conflict.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::InferenceWorkerSet;
use crate::v1alpha1::NameConflict;

/// The names `ws` claims, each with the model it means.
pub fn claims(ws: &InferenceWorkerSet) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for m in &ws.spec.models {
        out.insert(m.name.clone(), m.name.clone());
        for a in &m.aliases {
            out.insert(a.clone(), m.name.clone());
        }
    }
    if let Some(status) = &ws.status {
        for m in &status.models {
            out.entry(m.name.clone()).or_insert_with(|| m.name.clone());
        }
    }
    out
}

/// One worker set taking part.
#[derive(Clone, Debug)]
pub struct Claimant {
    /// Its name.
    pub name: String,
    /// Its `creationTimestamp`.
    pub created: Option<Time>,
    /// The pools naming it.
    pub pools: Vec<String>,
    /// What it claims ([`claims`]).
    pub claims: BTreeMap<String, String>,
}

/// What the rule decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Rejected worker sets, each with its clashes described.
    pub rejected: BTreeMap<String, Vec<String>>,
    /// Per pool, each contested name with its claimants.
    pub conflicts: BTreeMap<String, Vec<NameConflict>>,
}

/// Applies the rule to `claimants` (sets in no pool take no part).
pub fn decide(mut claimants: Vec<Claimant>) -> Decision {
    claimants.sort_by(|a, b| a.created.cmp(&b.created).then_with(|| a.name.cmp(&b.name)));
    let mut out = Decision::default();
    // Per pool, per name: its meaning and claimant.
    let mut admitted: BTreeMap<String, BTreeMap<String, (String, String)>> = BTreeMap::new();
    // Per pool, per contested name: claimants in admission order.
    let mut contested: BTreeMap<String, BTreeMap<String, Vec<(String, String)>>> = BTreeMap::new();
    for c in claimants {
        let mut clashes: Vec<String> = Vec::new();
        for pool in &c.pools {
            let held = admitted.entry(pool.clone()).or_default();
            for (claimed, meaning) in &c.claims {
                if let Some((other_meaning, holder)) = held.get(claimed)
                    && other_meaning != meaning
                {
                    clashes.push(format!(
                        "{claimed:?} means {meaning} here but {other_meaning} in the older worker set {holder} of pool {pool}"
                    ));
                    let entry = contested
                        .entry(pool.clone())
                        .or_default()
                        .entry(claimed.clone())
                        .or_default();
                    if entry.is_empty() {
                        entry.push((holder.clone(), other_meaning.clone()));
                    }
                    entry.push((c.name.clone(), meaning.clone()));
                }
            }
        }
        if clashes.is_empty() {
            for pool in &c.pools {
                let held = admitted.entry(pool.clone()).or_default();
                for (claimed, meaning) in &c.claims {
                    held.entry(claimed.clone())
                        .or_insert_with(|| (meaning.clone(), c.name.clone()));
                }
            }
        } else {
            out.rejected.insert(c.name, clashes);
        }
    }
    for (pool, names) in contested {
        let list = names
            .into_iter()
            .map(|(claimed, claimants)| {
                let kept = claimants[0].0.clone();
                let mut sets: Vec<String> = claimants.iter().map(|(s, _)| s.clone()).collect();
                let meanings: Vec<String> = claimants
                    .iter()
                    .map(|(s, m)| format!("{m} in {s}"))
                    .collect();
                let verb = if sets.len() > 2 { "are" } else { "is" };
                let rejected = format!("{} {verb}", sets[1..].join(", "));
                sets.dedup();
                NameConflict {
                    name: claimed.clone(),
                    worker_sets: sets,
                    message: format!(
                        "{claimed:?} means {}; {kept} is older and keeps it, {rejected} rejected with AliasConflict: rename it in one of them",
                        meanings.join(" and ")
                    ),
                }
            })
            .collect();
        out.conflicts.insert(pool, list);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claimant(name: &str, created: i64, claims: &[(&str, &str)]) -> Claimant {
        Claimant {
            name: name.into(),
            created: Some(Time(
                k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
            )),
            pools: vec!["p".into()],
            claims: claims
                .iter()
                .map(|(n, m)| ((*n).to_owned(), (*m).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn the_oldest_claim_wins_and_same_meanings_share() {
        let d = decide(vec![
            claimant("newer", 20, &[("m2", "m2"), ("fast", "m2")]),
            claimant("older", 10, &[("m1", "m1"), ("fast", "m1")]),
            claimant("twin", 30, &[("m1", "m1"), ("fast", "m1")]),
        ]);
        assert_eq!(d.rejected.keys().collect::<Vec<_>>(), ["newer"]);
        assert!(d.rejected["newer"][0].contains("older"));
        let c = &d.conflicts["p"];
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].name, "fast");
        assert_eq!(c[0].worker_sets, ["older", "newer"]);
    }
}
