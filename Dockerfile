# handoffs in a container: `docker build -t handoffs .`, or `docker compose up` (compose.yaml).
# Two stages: the build on the Rust image, then the binary alone on a distroless base that
# holds glibc and nothing else (no shell, no package manager), running as a user without
# privileges. The binary needs only glibc: SQLite is built in, TLS is rustls.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin handoffs \
 && strip target/release/handoffs \
 && mkdir -p /out/home/state

FROM gcr.io/distroless/cc-debian12:nonroot
# The MCP registry matches an OCI package to its server.json by this label.
LABEL io.modelcontextprotocol.server.name="io.github.handoffs/handoffs"
COPY --from=build /src/target/release/handoffs /usr/local/bin/handoffs
# Files of this machine (the page's token, command runs' outputs) and a SQLite database,
# when one is used, live under the user's home; mount a volume there to keep them. The
# folder is made here, the user's own: Docker fills a new named volume from the image's
# folder, owner included, and would otherwise make it root's (podman gives it to the user).
# Copied as an entry of the home folder, so that --chown applies to the folder itself.
COPY --from=build --chown=65532:65532 /out/home/ /home/nonroot/
ENV HANDOFFS_STATE_DIR=/home/nonroot/state
WORKDIR /home/nonroot
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/handoffs"]
CMD ["--help"]
