// A real OpenID Connect provider for tests (panva's oidc-provider with its development sign-in pages).
// node provider.mjs PORT CONSOLE_REDIRECT_URI ACCOUNTS_JSON
//   ACCOUNTS_JSON: {"alice": ["approver"], ...}: who may sign in (any password) and the roles claim each gets.
// Clients: "tether-console" (a web client, the control plane's /ui/oidc/callback) and "tether-cli" (a native
// client: a loopback redirect on any port, RFC 8252). Both public, PKCE required.
import Provider from 'oidc-provider';

const [port, consoleRedirect, accountsJson] = process.argv.slice(2);
const accounts = JSON.parse(accountsJson);
const issuer = `http://127.0.0.1:${port}`;

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: 'tether-console', token_endpoint_auth_method: 'none', application_type: 'web',
      redirect_uris: [consoleRedirect], grant_types: ['authorization_code'], response_types: ['code'],
    },
    {
      client_id: 'tether-cli', token_endpoint_auth_method: 'none', application_type: 'native',
      redirect_uris: ['http://127.0.0.1/callback'], grant_types: ['authorization_code'], response_types: ['code'],
    },
  ],
  pkce: { required: () => true },
  claims: { openid: ['sub'], profile: ['preferred_username', 'tether_roles'] },
  conformIdTokenClaims: false, // the roles claim is in the ID token itself, as most providers can be told to do
  cookies: { keys: ['tether-test-only'] },
  async findAccount(ctx, id) {
    if (!(id in accounts)) return undefined;
    return {
      accountId: id,
      async claims() { return { sub: id, preferred_username: id, tether_roles: accounts[id] }; },
    };
  },
});
provider.proxy = false;
provider.on('server_error', (ctx, err) => console.error('server_error', err));
provider.listen(Number(port), '127.0.0.1', () => console.log(`oidc-provider listening on ${issuer}`));
