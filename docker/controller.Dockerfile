# syntax=docker/dockerfile:1
# The image of the kinference controller: status and diagnoses for InferenceWorkerSets and InferencePools.
# Build from the workspace root (the context must be the whole workspace):
#   docker build -f docker/controller.Dockerfile -t kinference-controller:0.1.0 .

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
    cargo build --release --locked --package kinference-controller --bin kinference-controller \
    && cp target/release/kinference-controller /kinference-controller

# glibc, libgcc and CA certificates; no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kinference-controller" \
      org.opencontainers.image.description="the kinference controller: status and diagnoses for InferenceWorkerSets and InferencePools" \
      org.opencontainers.image.source="https://github.com/buoyant/kinference" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /kinference-controller /usr/local/bin/kinference-controller
# distroless's "nonroot" user, by number so that Kubernetes' runAsNonRoot can
# check it.
USER 65532:65532
# /metrics, /healthz, /readyz
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/kinference-controller"]
