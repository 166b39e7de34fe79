# The gateway's container image (deploy/image/Dockerfile), for the deploy files:
#   make gateway-image      the release binary on the kernel image's Debian, tagged
#                           kernelgate-gateway:latest; no registry needed
#   make gateway-image-gvisor   the same with runsc, for `--engine gvisor` (below)
GATEWAY_IMAGE := kernelgate-gateway:latest

.PHONY: gateway-image
gateway-image: image
	$(CARGO) build --release -p kernelgate
	@context=$$(mktemp -d) && trap 'rm -rf "$$context"' EXIT && \
		cp '$(KERNELGATE_ROOT)/target/release/kernelgate' '$(KERNELGATE_ROOT)/deploy/image/Dockerfile' "$$context/" && \
		DOCKER_BUILDKIT=0 docker build --quiet --build-arg BASE='$(KERNEL_IMAGE)' -t '$(GATEWAY_IMAGE)' "$$context" >/dev/null && \
		echo 'built $(GATEWAY_IMAGE)'

# The gateway's image under `--engine gvisor` (deploy/image/Dockerfile.gvisor), for
# deploy/kubernetes/kernelgate-gvisor.yaml: the release binary and the newest runsc `make
# gvisor` unpacked, on the kernel image's Debian, tagged kernelgate-gateway-gvisor:latest.
#   make gateway-image-gvisor
#   make gateway-image-gvisor GATEWAY_GVISOR_BIN=target/debug/kernelgate   (no release build)
GATEWAY_IMAGE_GVISOR := kernelgate-gateway-gvisor:latest
GATEWAY_GVISOR_BIN ?=

.PHONY: gateway-image-gvisor
gateway-image-gvisor: image gvisor
	$(if $(GATEWAY_GVISOR_BIN),,$(CARGO) build --release -p kernelgate)
	@runsc=$$(ls -d /usr/local/lib/kernelgate/runsc/*/usr/bin/runsc 2>/dev/null | sort | tail -n 1); \
		[ -n "$$runsc" ] || runsc=$$(command -v runsc); \
		[ -n "$$runsc" ] || { echo 'error: no runsc: run `make gvisor`' >&2; exit 1; }; \
		'$(KERNELGATE_ROOT)/deploy/image/build-gvisor.sh' \
			'$(or $(GATEWAY_GVISOR_BIN),$(KERNELGATE_ROOT)/target/release/kernelgate)' \
			"$$runsc" '$(KERNEL_IMAGE)' '$(GATEWAY_IMAGE_GVISOR)'
