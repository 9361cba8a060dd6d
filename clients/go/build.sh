#!/bin/sh
# Build the Go client offline from Debian's packages (golang-go, protobuf-compiler,
# golang-google-grpc-dev, protoc-gen-go-grpc, golang-google-protobuf-dev,
# golang-github-golang-protobuf-1-5-dev): Go in GOPATH mode over /usr/share/gocode.
# protoc-gen-go is built from golang-google-protobuf-dev's source. Output: build/.
set -eu
cd "$(dirname "$0")"
root=$(cd ../.. && pwd)
out=$(pwd)/build
export GO111MODULE=off GOFLAGS= GOPATH="$out/gopath:/usr/share/gocode" GOCACHE="$out/cache"
mkdir -p "$out/bin" "$out/gopath/src/llamastream/v1"
go build -o "$out/bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
PATH="$out/bin:$PATH" protoc -I"$root/protos" \
    --go_out="$out/gopath/src/llamastream/v1" --go_opt=paths=source_relative \
    --go_opt=Mllamastream/v1/generation.proto=llamastream/v1 \
    --go-grpc_out="$out/gopath/src/llamastream/v1" --go-grpc_opt=paths=source_relative \
    --go-grpc_opt=Mllamastream/v1/generation.proto=llamastream/v1 \
    "$root/protos/llamastream/v1/generation.proto"
# (paths=source_relative writes llamastream/v1/*.go under the output directory)
mv "$out"/gopath/src/llamastream/v1/llamastream/v1/*.go "$out/gopath/src/llamastream/v1/"
rm -rf "$out/gopath/src/llamastream/v1/llamastream"
go build -o "$out/llamastream-chat" .
echo "built $out/llamastream-chat"
