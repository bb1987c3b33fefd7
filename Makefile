# gpuplex: build, test, demo, bench, install.
#
#   make demo   the simulator replays three busy containers (weights 1, 2, 3) sharing one GPU
#               and draws their execution windows (the container demo replaces it once the
#               node service and the podman hook land)
#   make test   what CI runs: format check, clippy with warnings as errors, every test
#   make bench  criterion benchmarks of the scheduler core, and the node service's switch latency,
#               registration round trip and CPU use with real cgroups (root) (docs/benchmarks.md)
#   make properties  the property tests at 5,000 random cases each, in release mode (minutes)

CARGO  ?= cargo
PREFIX ?= /usr/local
DEMO_SCENARIO ?= scheduler/scenarios/weights.toml

# The property tests explore a fixed seed in `make test`, so a run is reproducible and CI does not
# depend on luck; `make properties` explores fresh random cases, many more of them.
PROPTEST_SEED ?= 20261129

.PHONY: all build demo test fmt-check clippy bench bench-deps properties install

all: build

build:
	$(CARGO) build --release --workspace --locked

demo: build
	@echo "gpuplex demo: the scheduler core, simulated (no container, no GPU is touched)."
	@echo "Scenario: $(DEMO_SCENARIO)"
	@echo
	./target/release/gpuplex-sim --timeline $(DEMO_SCENARIO)

test: fmt-check clippy
	PROPTEST_RNG_SEED=$(PROPTEST_SEED) $(CARGO) test --workspace --locked

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

# The node service's benchmark compares a window switch with `runc pause` + `runc resume`.
bench-deps:
	@command -v runc >/dev/null && [ -x /bin/busybox ] || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends runc busybox-static

bench: bench-deps
	$(CARGO) bench -p gpuplex-scheduler --bench scheduler
	$(CARGO) bench -p gpuplex-shim --bench node_service

properties:
	PROPTEST_CASES=5000 $(CARGO) test --release --locked -p gpuplex-scheduler

# Installs the node service (containerd-shim-gpuplex-v1 serve), gpuplexctl, the simulator, the
# systemd unit and the documented configuration (never over an existing one).
install: build
	install -D -m 0755 target/release/containerd-shim-gpuplex-v1 $(DESTDIR)$(PREFIX)/bin/containerd-shim-gpuplex-v1
	install -D -m 0755 target/release/gpuplexctl $(DESTDIR)$(PREFIX)/bin/gpuplexctl
	install -D -m 0755 target/release/gpuplex-sim $(DESTDIR)$(PREFIX)/bin/gpuplex-sim
	install -D -m 0644 config/gpuplex.service $(DESTDIR)/etc/systemd/system/gpuplex.service
	@if [ -e $(DESTDIR)/etc/gpuplex/gpuplex.toml ]; then \
		echo "keeping the existing $(DESTDIR)/etc/gpuplex/gpuplex.toml"; \
	else \
		install -D -m 0644 config/gpuplex.toml $(DESTDIR)/etc/gpuplex/gpuplex.toml; \
	fi
