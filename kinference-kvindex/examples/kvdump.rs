//! `kvdump`: print KV events as JSON lines, one event per line.
//!
//! ```text
//! cargo run -p kinference-kvindex --example kvdump -- decode FILE
//! cargo run -p kinference-kvindex --example kvdump -- watch tcp://HOST:PORT [--replay tcp://HOST:PORT] [--topic PREFIX]
//! ```
//!
//! `decode` reads a `.msgpack` payload, or a `.frames` capture (live or
//! replay message). `watch` subscribes to a live publisher; with
//! `--replay` it first asks the replay socket for everything from seq 0.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use kinference_kvindex::codec::frames::{self, ReplayReply};
use kinference_kvindex::dump;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

#[derive(Parser, Debug)]
#[command(name = "kvdump", about = "Print vLLM/SGLang KV events as JSON lines")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Decode a `.msgpack` payload or a `.frames` capture.
    Decode {
        /// The file.
        file: std::path::PathBuf,
    },
    /// Tail a live publisher.
    Watch {
        /// The PUB endpoint, e.g. tcp://10.0.3.7:5557.
        endpoint: String,
        /// The replay ROUTER endpoint: print the replay buffer first.
        #[arg(long)]
        replay: Option<String>,
        /// Topic prefix.
        #[arg(long, default_value = "")]
        topic: String,
    },
}

fn decode(file: &std::path::Path) -> Result<()> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    print!("{}", dump::decode_file(&name, &bytes)?);
    Ok(())
}

async fn watch(endpoint: &str, replay: Option<&str>, topic: &str) -> Result<()> {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(Duration::from_millis(500));
    let mut sub = SubSocket::with_options(opts);
    sub.subscribe(topic).await?;
    while let Err(e) = sub.connect(endpoint).await {
        eprintln!("kvdump: {endpoint} not reachable yet ({e}); retrying");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if let Some(r) = replay {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(Duration::from_secs(2));
        let mut dealer = DealerSocket::with_options(opts);
        dealer
            .connect(r)
            .await
            .context("connecting to the replay socket")?;
        let req: Vec<Bytes> = frames::replay_request(0)
            .into_iter()
            .map(Bytes::from)
            .collect();
        dealer
            .send(ZmqMessage::try_from(req).map_err(|e| anyhow::anyhow!("{e:?}"))?)
            .await?;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
                .await
                .context("replay timed out")??;
            let parts: Vec<&[u8]> = m.iter().map(Bytes::as_ref).collect();
            match frames::parse_replay_reply(&parts)? {
                ReplayReply::Batch { seq, payload, .. } => {
                    print!(
                        "{}",
                        dump::payload_lines(payload, Some("replay"), Some(seq))
                    );
                }
                ReplayReply::End => break,
            }
        }
    }
    loop {
        let m = sub.recv().await?;
        let parts: Vec<&[u8]> = m.iter().map(Bytes::as_ref).collect();
        match frames::parse_live(&parts) {
            Ok(l) => {
                let topic = String::from_utf8_lossy(l.topic);
                print!(
                    "{}",
                    dump::payload_lines(l.payload, Some(&topic), Some(l.seq))
                );
            }
            Err(e) => eprintln!("kvdump: malformed message: {e}"),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    match args.cmd {
        Cmd::Decode { file } => decode(&file),
        Cmd::Watch {
            endpoint,
            replay,
            topic,
        } => {
            if !endpoint.starts_with("tcp://") && !endpoint.starts_with("ipc://") {
                bail!("endpoint must look like tcp://HOST:PORT");
            }
            watch(&endpoint, replay.as_deref(), &topic).await
        }
    }
}
