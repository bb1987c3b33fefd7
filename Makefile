# gpuplex: build, test, demo, bench, install.
#
#   make demo   (root) three podman containers (weights 1, 2, 3) time-share one fake GPU under
#               the node service; their windows live (gpuplexctl top), then their shares
#               (without root: the simulator's version of the same)
#   make test   what CI runs: format check, clippy with warnings as errors, every test, the
#               soak's short version (make test-soak) and the host suite (make test-hosts)
#   make test-hosts  (root) the host suite: a Debian 13 VM (systemd, cgroup v2, containerd 1.7,
#               podman 5) built with debootstrap (cached under target/hosts), booted with qemu,
#               the package installed in it and tests/hosts/checks run inside; HOSTS_CHECKS=REGEX
#               runs some of them
#   make bench  criterion benchmarks of the scheduler core, and the node service's switch latency,
#               registration round trip and CPU use with real cgroups (root) (docs/benchmarks.md)
#   make bench-bursts  (root) bursty demand beside steady work, real podman containers on one
#               fake GPU (tests/bench_bursts.sh); BEFORE=DIR also runs each case with the binaries
#               in DIR (the core before a change) first, STRESS=1 again with every CPU kept busy
#   make soak   (root) churn with faults injected for SOAK_MINUTES (default 60): podman and
#               containerd containers started and removed at seeded random on 4 fake GPUs while
#               the node service is killed, stopped and starved of state_dir, containerd is
#               killed and shims are killed, its invariants checked every second (tests/soak/);
#               SOAK_SEED=N replays a run (default: a random seed, printed)
#   make test-soak  (root) its short version in make test: 3 minutes, seed 31, the debug binaries
#   make properties  the property tests at 5,000 random cases each, in release mode (minutes)
#   make fuzz   each cargo-fuzz target (fuzz/) for FUZZ_SECONDS (default 60), on nightly; not in
#               `make test`, which replays what the fuzzers found (fuzz/regressions/)
#   make deb    the Debian package gpuplex_<version>-1_<arch>.deb, here, with cargo-deb (installed
#               when missing): apt install ./gpuplex_*.deb (shim/Cargo.toml says what is in it)
#   make image  the node image of config/kubernetes/gpuplex.yaml (localhost/gpuplex:0.1.0) with
#               podman, from the release binaries (PROFILE=debug: the debug ones); no registry

CARGO  ?= cargo
PREFIX ?= /usr/local
DEMO_SCENARIO ?= scheduler/scenarios/weights.toml

# The property tests explore a fixed seed in `make test`, so a run is reproducible and CI does not
# depend on luck; `make properties` explores fresh random cases, many more of them.
PROPTEST_SEED ?= 20261129

.PHONY: all build demo test test-soak test-hosts hosts-deps test-deps cargo-deb fmt-check clippy bench bench-deps bench-bursts soak properties fuzz install deb image image-deps

all: build

build:
	$(CARGO) build --release --workspace --locked

# make demo builds only what it runs: as root the node service (the shim's binary), the hook
# and gpuplexctl; without root the simulator. Not the DRA driver (kube, tonic) nor the tests.
DEMO_BINS = -p gpuplex-shim --bin containerd-shim-gpuplex-v1 -p gpuplex-hook --bin gpuplex-hook \
	-p gpuplex-ctl --bin gpuplexctl
demo: test-deps
	@if [ "$$(id -u)" = 0 ]; then \
		$(CARGO) build --release --locked $(DEMO_BINS) && \
		bash tests/demo.sh; \
	else \
		echo "make demo runs podman containers and needs root (sudo make demo)."; \
		echo "Meanwhile, the scheduler core simulated (no container, no GPU is touched):"; \
		echo; \
		$(CARGO) build --release --locked -p gpuplex-scheduler --bin gpuplex-sim && \
		./target/release/gpuplex-sim --timeline $(DEMO_SCENARIO); \
	fi

# $(call apt_install,PACKAGES,NOT ROOT): installs those of the Debian PACKAGES that are missing
# (as root; an `apt-get update` only when the first try fails); without root it runs the shell
# command NOT ROOT instead, with $$missing naming them.
apt_install = missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing:$$missing"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing >/dev/null || \
			{ apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing >/dev/null; }; \
		else \
			$(2); \
		fi; \
	fi

# What the end-to-end tests run (tests/: podman, runc, containerd;
# ../shared/notes/container-stack.md), from Debian, installed when missing (as root; without root
# the tests that need them skip).
TEST_PACKAGES = runc crun podman conmon fuse-overlayfs slirp4netns uidmap busybox-static containerd protobuf-compiler
test-deps:
	@$(call apt_install,$(TEST_PACKAGES),echo "not root: not installing$$missing (the tests that need them will skip)")

# The integration tests run the workspace's binaries (found by gpuplex_integration::bin, which
# refuses one older than its sources); `cargo test` builds only those of packages with tests/.
test: test-deps cargo-deb fmt-check clippy
	$(CARGO) build --workspace --bins --locked
	PROPTEST_RNG_SEED=$(PROPTEST_SEED) $(CARGO) test --workspace --locked
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory test-soak test-hosts; else \
		echo "SKIPPED: make test-soak and make test-hosts need root (podman; debootstrap, qemu); CI runs them as root"; fi

# The host suite (tests/hosts/README.md): the hosts users run, in a VM this machine boots.
test-hosts: hosts-deps cargo-deb
	bash tests/hosts/run.sh

hosts-deps:
	@bash tests/hosts/deps.sh

# cargo-deb, at the version the package was written for: `make deb` builds with it, and
# tests/tests/package.rs builds a package of the debug binaries with it and installs that.
CARGO_DEB_VERSION = 3.8.0
cargo-deb:
	@cargo-deb --version 2>/dev/null | grep -qx 'cargo-deb $(CARGO_DEB_VERSION)' || \
		$(CARGO) install cargo-deb --version $(CARGO_DEB_VERSION) --locked

# The package of the release binaries, built first (cargo-deb packs them as built), written here.
deb: cargo-deb build
	$(CARGO) deb -p gpuplex-shim --no-build --locked --output .

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

# The node service's benchmark compares a window switch with `runc pause` + `runc resume`; the
# hook's, container starts with and without it; the containerd shim's, `ctr run` through it and
# through containerd's runc shim (hyperfine).
bench-deps: test-deps
	@command -v hyperfine >/dev/null || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends hyperfine

bench: bench-deps
	$(CARGO) bench -p gpuplex-scheduler --bench scheduler
	$(CARGO) build --release --workspace --locked
	$(CARGO) bench -p gpuplex-node --bench node_service
	bash tests/bench_hook.sh
	bash tests/bench_shim.sh

# Bursty containers beside steady ones under the node service, measured from its window events
# (tests/README.md); BEFORE=DIR: a release build of the core before a change (its
# containerd-shim-gpuplex-v1 and gpuplex-hook), run before the one built here in each case.
BEFORE ?=
STRESS ?=
bench-bursts: test-deps
	@[ "$$(id -u)" = 0 ] || { echo "make bench-bursts runs podman containers and needs root (sudo make bench-bursts)"; exit 1; }
	$(CARGO) build --release --locked --bins
	GPUPLEX_BEFORE_BIN_DIR='$(BEFORE)' GPUPLEX_BURST_STRESS='$(STRESS)' bash tests/bench_bursts.sh

# The soak (tests/soak/soak.sh, tests/README.md): podman and containerd; an hour by default, so
# `make test` runs only test-soak, its 3-minute version on the binaries `make test` built.
# SOAK_MIN, SOAK_MAX, SOAK_FAULT_EVERY, SOAK_CHURN, SOAK_CPUS, SOAK_CONTAINERD, SOAK_PODS and
# SOAK_KEEP are read from the environment (soak.sh says what each does).
SOAK_MINUTES ?= 60
SOAK_SEED ?=
soak: test-deps
	@[ "$$(id -u)" = 0 ] || { echo "make soak runs podman containers and needs root (sudo make soak)"; exit 1; }
	$(CARGO) build --release --locked --bins
	$(CARGO) build --release --locked -p gpuplex-dra --example kubelet-standin
	SOAK_MINUTES='$(SOAK_MINUTES)' SOAK_SEED='$(SOAK_SEED)' bash tests/soak/soak.sh

test-soak: test-deps
	@[ "$$(id -u)" = 0 ] || { echo "make test-soak runs podman containers and needs root (sudo make test-soak)"; exit 1; }
	$(CARGO) build --workspace --bins --locked
	$(CARGO) build --locked -p gpuplex-dra --example kubelet-standin
	GPUPLEX_BIN_DIR='$(CURDIR)/target/debug' SOAK_MINUTES=3 SOAK_SEED=31 bash tests/soak/soak.sh

properties:
	PROPTEST_CASES=5000 $(CARGO) test --release --locked -p gpuplex-scheduler

# The fuzz targets (fuzz/fuzz_targets/, their bodies in fuzz/src/bodies.rs) need a nightly
# toolchain and cargo-fuzz (installed when missing). Each runs for FUZZ_SECONDS, starting from
# fuzz/regressions/<target>/ and what earlier runs kept in fuzz/corpus/<target>/; an input that
# fails is left in fuzz/artifacts/<target>/ (`cargo +nightly fuzz tmin <target> <file>`
# minimizes it). Fix what it found and keep the input in fuzz/regressions/<target>/, which
# tests/tests/fuzz_regressions.rs replays in `make test`. Every target runs; the make fails at
# the end if any found something.
FUZZ_SECONDS ?= 60
FUZZ_CARGO   ?= cargo +nightly

fuzz:
	@$(FUZZ_CARGO) fuzz --version >/dev/null 2>&1 || $(CARGO) install cargo-fuzz --locked
	$(FUZZ_CARGO) fuzz build
	@failed=""; for t in $$($(FUZZ_CARGO) fuzz list); do \
		mkdir -p fuzz/corpus/$$t; \
		echo "== fuzz $$t for $(FUZZ_SECONDS)s"; \
		$(FUZZ_CARGO) fuzz run $$t fuzz/corpus/$$t fuzz/regressions/$$t -- \
			-max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || failed="$$failed $$t"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: found something in:$$failed (see fuzz/artifacts/)"; exit 1; fi

# The image the DaemonSet of config/kubernetes/gpuplex.yaml runs: `FROM scratch`
# (config/image/Containerfile) with the four binaries, the shared libraries they link and Debian's
# static busybox for the init container's shell, staged by config/image/stage.sh under
# target/image/ (no base image is pulled, no registry is needed). Load it into a node's
# containerd with `podman save localhost/gpuplex:0.1.0 | ctr -n k8s.io images import -`.
# PROFILE=debug builds it from the debug binaries (what dra/tests/image.rs checks, quicker to
# build); PODMAN="podman --storage-driver vfs" where overlay does not work.
IMAGE   ?= localhost/gpuplex:0.1.0
PROFILE ?= release
PODMAN  ?= podman
IMAGE_PACKAGES = podman busybox-static

image-deps:
	@$(call apt_install,$(IMAGE_PACKAGES),echo "make image needs$$missing: apt-get install$$missing (as root)"; exit 1)

image: image-deps
	$(CARGO) build $(if $(filter release,$(PROFILE)),--release,$(if $(filter debug,$(PROFILE)),,--profile $(PROFILE))) --locked --workspace --bins
	bash config/image/stage.sh target/$(PROFILE) target/image/$(PROFILE)
	$(PODMAN) build --tag $(IMAGE) --file config/image/Containerfile target/image/$(PROFILE)

# Installs the node service (containerd-shim-gpuplex-v1 serve), gpuplexctl, the DRA plugin
# (gpuplex-dra), the NRI plugin (gpuplex-nri, its unit not enabled), the Kubernetes manifests, the hook and its
# podman hooks.d files and runc snippet (under $(PREFIX)/share/gpuplex), the simulator, the
# systemd unit and the documented configuration (never over an existing one).
install: build
	install -D -m 0755 target/release/containerd-shim-gpuplex-v1 $(DESTDIR)$(PREFIX)/bin/containerd-shim-gpuplex-v1
	install -D -m 0755 target/release/gpuplexctl $(DESTDIR)$(PREFIX)/bin/gpuplexctl
	install -D -m 0755 target/release/gpuplex-sim $(DESTDIR)$(PREFIX)/bin/gpuplex-sim
	install -D -m 0755 target/release/gpuplex-hook $(DESTDIR)$(PREFIX)/bin/gpuplex-hook
	install -D -m 0755 target/release/gpuplex-dra $(DESTDIR)$(PREFIX)/bin/gpuplex-dra
	install -D -m 0755 target/release/gpuplex-nri $(DESTDIR)$(PREFIX)/bin/gpuplex-nri
	mkdir -p $(DESTDIR)$(PREFIX)/share/gpuplex/hooks.d
	for f in config/hooks.d/*.json; do \
		sed 's|/usr/bin/gpuplex-hook|$(PREFIX)/bin/gpuplex-hook|' $$f \
			> $(DESTDIR)$(PREFIX)/share/gpuplex/hooks.d/$$(basename $$f); \
	done
	sed 's|/usr/bin/gpuplex-hook|$(PREFIX)/bin/gpuplex-hook|' config/runc-hooks.json \
		> $(DESTDIR)$(PREFIX)/share/gpuplex/runc-hooks.json
	install -D -m 0644 config/containerd/config-v2.toml $(DESTDIR)$(PREFIX)/share/gpuplex/containerd/config-v2.toml
	install -D -m 0644 config/containerd/config-v3.toml $(DESTDIR)$(PREFIX)/share/gpuplex/containerd/config-v3.toml
	install -D -m 0644 config/kubernetes/runtimeclass.yaml $(DESTDIR)$(PREFIX)/share/gpuplex/kubernetes/runtimeclass.yaml
	install -D -m 0644 config/kubernetes/deviceclass.yaml $(DESTDIR)$(PREFIX)/share/gpuplex/kubernetes/deviceclass.yaml
	install -D -m 0644 config/kubernetes/gpuplex.yaml $(DESTDIR)$(PREFIX)/share/gpuplex/kubernetes/gpuplex.yaml
	install -D -m 0644 config/kubernetes/gpuplex-nri.yaml $(DESTDIR)$(PREFIX)/share/gpuplex/kubernetes/gpuplex-nri.yaml
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/gpuplex/kubernetes/examples config/kubernetes/examples/*.yaml
	mkdir -p $(DESTDIR)/etc/systemd/system
	sed 's|/usr/bin/containerd-shim-gpuplex-v1|$(PREFIX)/bin/containerd-shim-gpuplex-v1|' config/gpuplex.service \
		> $(DESTDIR)/etc/systemd/system/gpuplex.service
	install -m 0644 config/gpuplex.socket $(DESTDIR)/etc/systemd/system/gpuplex.socket
	sed 's|/usr/bin/gpuplex-nri|$(PREFIX)/bin/gpuplex-nri|' config/nri/gpuplex-nri.service \
		> $(DESTDIR)/etc/systemd/system/gpuplex-nri.service
	@if [ -e $(DESTDIR)/etc/gpuplex/gpuplex.toml ]; then \
		echo "keeping the existing $(DESTDIR)/etc/gpuplex/gpuplex.toml"; \
	else \
		install -D -m 0644 config/gpuplex.toml $(DESTDIR)/etc/gpuplex/gpuplex.toml; \
	fi
