//! `kinference-controller`: see the library's documentation.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kinference_controller::Args::parse().run().await?;
    Ok(())
}
