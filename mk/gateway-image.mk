# The gateway's container image (deploy/image/Dockerfile), for the deploy files:
#   make gateway-image      the release binary on the kernel image's Debian, tagged
#                           kernelgate-gateway:latest; no registry needed
GATEWAY_IMAGE := kernelgate-gateway:latest

.PHONY: gateway-image
gateway-image: image
	$(CARGO) build --release -p kernelgate
	@context=$$(mktemp -d) && trap 'rm -rf "$$context"' EXIT && \
		cp '$(KERNELGATE_ROOT)/target/release/kernelgate' '$(KERNELGATE_ROOT)/deploy/image/Dockerfile' "$$context/" && \
		DOCKER_BUILDKIT=0 docker build --quiet --build-arg BASE='$(KERNEL_IMAGE)' -t '$(GATEWAY_IMAGE)' "$$context" >/dev/null && \
		echo 'built $(GATEWAY_IMAGE)'
