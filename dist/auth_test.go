//go:build linux

package dist_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tensormp/tensormp/dist"
	"github.com/tensormp/tensormp/internal/leakcheck"
	"github.com/tensormp/tensormp/tensor"
)

// selfSigned returns TLS configurations for a server and a client that
// trusts only it.
func selfSigned(t *testing.T) (server, client *tls.Config) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "tensormp test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP(hostAddr(0)), net.ParseIP(hostAddr(1))},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	server = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, MinVersion: tls.VersionTLS13}
	client = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}
	return server, client
}

// Two ranks (in one process: what is tested is the connection) with TLS
// and a token move a tensor; a rank with the wrong token cannot join.
func TestTLSAndToken(t *testing.T) {
	leakcheck.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, cli := selfSigned(t)
	store := freeStore(t)
	secure := func(r int, token string) []dist.Option {
		return []dist.Option{dist.WithRank(r, 2), dist.WithStore(store), dist.WithAddr(hostAddr(r)),
			dist.WithTLS(srv, cli), dist.WithToken(token), dist.WithHeartbeat(heartbeat), dist.WithTimeout(2 * time.Second)}
	}

	type joined struct {
		g   *dist.Group
		err error
	}
	zero := make(chan joined, 1)
	go func() {
		g, err := dist.Init(ctx, secure(0, "s3cret")...)
		zero <- joined{g, err}
	}()
	_, err := dist.Init(ctx, secure(1, "wrong")...)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "bearer token")
	j := <-zero
	require.Error(t, j.err, "rank 0 alone does not form the group")

	go func() {
		g, err := dist.Init(ctx, secure(0, "s3cret")...)
		zero <- joined{g, err}
	}()
	g1, err := dist.Init(ctx, secure(1, "s3cret")...)
	require.NoError(t, err)
	j = <-zero
	require.NoError(t, j.err)
	q1, err := g1.Queue(ctx, "q")
	require.NoError(t, err)
	x, err := tensor.Arange(tensor.Int16, 100)
	require.NoError(t, err)
	require.NoError(t, q1.Put(ctx, x))
	q0, err := j.g.Queue(ctx, "q")
	require.NoError(t, err)
	var y *tensor.Tensor
	require.NoError(t, q0.Get(ctx, &y))
	assert.True(t, tensor.Equal(x, y))
	_ = y.Release()
	require.NoError(t, g1.Close())
	require.NoError(t, j.g.Close())
}
