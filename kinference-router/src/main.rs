//! `kinference-router`: see the library docs.

use clap::Parser as _;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = kinference_router::args::Args::parse();
    match args.run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg = format!("{msg}: {s}");
                source = s.source();
            }
            eprintln!("{msg}");
            std::process::ExitCode::FAILURE
        }
    }
}
