//! Memory limits: how many entries fit in a byte budget.
//!
//! The index's memory is dominated by its entries, so the budget is
//! expressed in entries ([`super::IndexConfig::max_entries`]) and derived
//! from bytes with one measured figure, [`BYTES_PER_ENTRY`]. The figure is
//! the allocator's bytes per entry on the branching workload v1b (shared
//! trunks that fork, 2.25 holders per key: the shape of real multi-turn
//! traffic, and the index's most expensive shape per entry of the
//! benchmarked ones), rounded up, so a budget holds at least that many
//! entries' worth of real traffic. Workload v1 (10 holders per key) costs
//! far less per entry. See `benches/README.md` for how it is measured.

/// Allocator bytes per (block, worker, group) entry used to size the
/// budget (workload v1b, measured; see the module docs).
pub const BYTES_PER_ENTRY: u64 = 24;

/// The `max_entries` that keeps the index within `budget_bytes`, from the
/// measured [`BYTES_PER_ENTRY`]; at least 1.
///
/// A router sizing its index from a container memory limit should pass
/// the share of the limit it gives the index (the limit minus what the
/// rest of the process needs), not the whole limit.
pub const fn max_entries_for_budget(budget_bytes: u64) -> u64 {
    let n = budget_bytes / BYTES_PER_ENTRY;
    if n == 0 { 1 } else { n }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_turn_into_entries() {
        assert_eq!(max_entries_for_budget(0), 1);
        assert_eq!(max_entries_for_budget(BYTES_PER_ENTRY * 1000), 1000);
        // The chart's 2 GiB limit with 1 GiB for the index.
        assert_eq!(max_entries_for_budget(1 << 30), (1 << 30) / BYTES_PER_ENTRY);
    }
}
