# syntax=docker/dockerfile:1
# The image of the kinference router: an OpenAI-compatible, KV-cache-aware router.
# Build from the workspace root (the context must be the whole workspace):
#   docker build -f docker/router.Dockerfile -t kinference-router:0.1.0 .

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
    cargo build --release --locked --package kinference-router --bin kinference-router \
    && cp target/release/kinference-router /kinference-router

# glibc, libgcc and CA certificates; no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kinference-router" \
      org.opencontainers.image.description="the kinference router: an OpenAI-compatible, KV-cache-aware router" \
      org.opencontainers.image.source="https://github.com/buoyant/kinference" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /kinference-router /usr/local/bin/kinference-router
# distroless's "nonroot" user, by number so that Kubernetes' runAsNonRoot can
# check it.
USER 65532:65532
# 8080: the OpenAI API; 9090: /metrics, /healthz, /readyz, /debug/*
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/kinference-router"]
CMD ["--help"]
