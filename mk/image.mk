# The kernel container image. Included by the root Makefile; usable alone too:
#   make -f mk/image.mk image
#
#   make image                      offline build (kernel-image/build-offline.sh): Debian
#                                   packages + PyPI, no container registry needed (default)
#   make image IMAGE_BUILD=docker   `docker build` of kernel-image/Dockerfile (needs a registry)
#   make image-archive              the image as `docker save` writes it, in
#                                   $(KERNEL_IMAGE_ARCHIVE), for `kernelgate image import`
#                                   (the image store of engines without Docker,
#                                   docs/image-store.md)
#
# The tag is the first 12 hex digits of a sha256 over the names and contents of all files in
# kernel-image/ (sorted; build output, __pycache__, editor files, *.md and the derived-image
# tooling excluded: they are no input of the image), so any change there makes a new image
# and an unchanged tree is never rebuilt. The image is also tagged kernelgate-kernel:latest.
# Other targets pass $(KERNEL_IMAGE) to the gateway (--image).

KERNELGATE_ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST)))..)
KERNEL_IMAGE_NAME := kernelgate-kernel
KERNEL_IMAGE_TAG := $(shell cd '$(KERNELGATE_ROOT)' && \
	find kernel-image \( -path kernel-image/build -o -path kernel-image/derived -o -name __pycache__ \) -prune -o \
		-type f ! -name '*.pyc' ! -name '*~' ! -name '.*.swp' ! -name '*.md' ! -name derive.sh -print0 \
	| LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)
KERNEL_IMAGE := $(KERNEL_IMAGE_NAME):$(KERNEL_IMAGE_TAG)
KERNEL_IMAGE_LATEST := $(KERNEL_IMAGE_NAME):latest
IMAGE_BUILD ?= offline
KERNEL_IMAGE_ARCHIVE := $(KERNELGATE_ROOT)/target/images/$(KERNEL_IMAGE_NAME)-$(KERNEL_IMAGE_TAG).tar

.PHONY: image
image:
	@if ! docker info >/dev/null 2>&1; then \
		echo 'error: Docker is not running: start it with `systemctl start docker` (or `service docker start`), then run `make image` again' >&2; \
		exit 1; \
	fi
	@case '$(IMAGE_BUILD)' in offline|docker) ;; \
		*) echo "error: IMAGE_BUILD must be 'offline' or 'docker', not '$(IMAGE_BUILD)'" >&2; exit 2 ;; \
	esac
	@if docker image inspect '$(KERNEL_IMAGE)' >/dev/null 2>&1; then \
		docker tag '$(KERNEL_IMAGE)' '$(KERNEL_IMAGE_LATEST)'; \
		echo '$(KERNEL_IMAGE) is up to date'; \
	else \
		case '$(IMAGE_BUILD)' in \
		offline) '$(KERNELGATE_ROOT)/kernel-image/build-offline.sh' '$(KERNEL_IMAGE)' '$(KERNEL_IMAGE_LATEST)' ;; \
		docker) docker build --label org.kernelgate.build=docker -t '$(KERNEL_IMAGE)' -t '$(KERNEL_IMAGE_LATEST)' '$(KERNELGATE_ROOT)/kernel-image' ;; \
		esac; \
	fi

# The image's root filesystem and config, for hosts (or containers) without Docker: copy the
# file there and run `kernelgate image import FILE`. Both tags go in; written once per tag,
# through a temporary file so that an interrupted save leaves nothing under the name.
.PHONY: image-archive
image-archive: image
	@if [ -f '$(KERNEL_IMAGE_ARCHIVE)' ]; then \
		echo '$(KERNEL_IMAGE_ARCHIVE) is up to date'; \
	else \
		mkdir -p '$(dir $(KERNEL_IMAGE_ARCHIVE))' && \
		docker save -o '$(KERNEL_IMAGE_ARCHIVE).tmp' '$(KERNEL_IMAGE)' '$(KERNEL_IMAGE_LATEST)' && \
		mv '$(KERNEL_IMAGE_ARCHIVE).tmp' '$(KERNEL_IMAGE_ARCHIVE)' && \
		echo 'wrote $(KERNEL_IMAGE_ARCHIVE): `kernelgate image import` it'; \
	fi

# The derived image the custom-image tests use: ours plus the fixture package of
# tests/fixtures/kg_fixture, built the documented way (kernel-image/derive.sh, see
# docs/custom-images.md). Tagged by a hash of its inputs, so it is built once per change.
FIXTURE_TAG := $(shell cd '$(KERNELGATE_ROOT)' && { echo '$(KERNEL_IMAGE_TAG)'; \
	find tests/fixtures/kg_fixture kernel-image/derive.sh kernel-image/derived -type f \
		! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-12)
FIXTURE_IMAGE := kernelgate-fixture:$(FIXTURE_TAG)
# A Python with pip on this host (the root Makefile uses the test venv's).
FIXTURE_PYTHON ?= python3

.PHONY: fixture-image
fixture-image: image
	@if docker image inspect '$(FIXTURE_IMAGE)' >/dev/null 2>&1; then \
		echo '$(FIXTURE_IMAGE) is up to date'; \
	else \
		PYTHON='$(FIXTURE_PYTHON)' '$(KERNELGATE_ROOT)/kernel-image/derive.sh' \
			-b '$(KERNEL_IMAGE)' -t '$(FIXTURE_IMAGE)' -n 'Python 3 + kg_fixture' \
			-l '$(KERNELGATE_ROOT)/tests/fixtures/kg_fixture/logo-64x64.png' \
			'$(KERNELGATE_ROOT)/tests/fixtures/kg_fixture'; \
	fi
