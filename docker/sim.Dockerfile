# syntax=docker/dockerfile:1
# The image of kinference-sim: a vLLM-compatible engine simulator, for tests and demos (not an inference engine).
# Build from the workspace root (the context must be the whole workspace):
#   docker build -f docker/sim.Dockerfile -t kinference-sim:0.1.0 .

# The toolchain the workspace is tested with (rust-version in Cargo.toml is
# the oldest that builds it). The build stage's Debian release matches the
# runtime's, so the binary links against the same glibc.
ARG RUST_VERSION=1.95.0

FROM rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY . .
# --locked: exactly the versions in Cargo.lock.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --package kinference-sim --bin kinference-sim \
    && cp target/release/kinference-sim /kinference-sim

# glibc, libgcc and CA certificates; no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kinference-sim" \
      org.opencontainers.image.description="kinference-sim: a vLLM-compatible engine simulator, for tests and demos (not an inference engine)" \
      org.opencontainers.image.source="https://github.com/buoyant/kinference" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /kinference-sim /usr/local/bin/kinference-sim
# distroless's "nonroot" user, by number so that Kubernetes' runAsNonRoot can
# check it.
USER 65532:65532
# 8000: vLLM's HTTP API of engine 0 (engine i: 8000+i); 5557: its KV-event PUB socket
EXPOSE 8000 5557
ENTRYPOINT ["/usr/local/bin/kinference-sim"]
CMD ["--engines", "1"]
