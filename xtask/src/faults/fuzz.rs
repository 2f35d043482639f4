//! The KV-event and request-body fuzzers (release builds).

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn fuzz(env: &Env, opts: &Options, f: &mut Figures) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let runs: [(&str, &[&str], (&str, String)); 2] = [
        (
            "kv events",
            &[
                "test",
                "--release",
                "-p",
                "kinference-kvindex",
                "--test",
                "fuzz",
                "--",
                "--nocapture",
            ],
            ("KINFERENCE_FUZZ_INPUTS", opts.fuzz_inputs.to_string()),
        ),
        (
            "request bodies",
            &[
                "test",
                "--release",
                "-p",
                "kinference-router",
                "--test",
                "hostile",
                "mutated_bodies_never_panic",
                "--",
                "--nocapture",
            ],
            (
                "KINFERENCE_FUZZ_REQUESTS",
                (opts.fuzz_inputs / 5).to_string(),
            ),
        ),
    ];
    for (what, args, (k, v)) in runs {
        let out = std::process::Command::new(&cargo)
            .current_dir(&env.root)
            .args(args)
            .env(k, v)
            .output()
            .with_context(|| format!("running the {what} fuzzer"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let figure = text
            .lines()
            .find(|l| l.starts_with("FIGURE"))
            .unwrap_or("no figure printed")
            .to_owned();
        if !out.status.success() {
            bail!("the {what} fuzzer failed:\n{text}");
        }
        f.notes.push(format!("fuzz {what}: {figure}"));
    }
    Ok(())
}
